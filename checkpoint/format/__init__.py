"""tenax.checkpoint.format — how a checkpoint lies on storage, torch-free except the codec.

- `Storage`: the fsspec seam every byte goes through (deadlines, atomic writes, checksums,
  confined paths; `validate_relpath`).
- `Catalog`: versions `step-NNNNNNNN` of one job, committed by `manifest.json` written last
  from a `CommitInfo`; verification, fallback past damage, retention. `version_name`,
  `parse_version_name`, `spec_hash` (the model hash a manifest records), `share_of` (each
  rank's share of a verification).
- `Manifest`, `FileEntry`, `VersionHealth`, `FORMAT_VERSION`, `METADATA_NAME`: the commit
  marker and what re-reading a version found.
- `Retention`, `retention_plan`: which versions to keep, as a pure decision.
- `file_crc32c`, `buffer_crc32c`, `crc32c_join`: one file's CRC32C over parallel ranges, joined
  into the value a single pass gives.
- The JSON `.metadata` codec (never a pickle): `encode_metadata`, `decode_metadata`,
  `ShardLocation`, `FORMAT`, `LEGACY_FORMAT` (the only module here that imports torch).

Names resolve lazily (PEP 562); the errors live in `tenax.checkpoint.errors`.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "storage": ("DEFAULT_CHECKSUM", "Storage", "validate_relpath"),
    "catalog": ("Catalog", "Deletion", "MANIFEST_NAME", "VersionInfo", "parse_version_name",
                "share_of", "spec_hash", "version_name"),
    "manifest": ("CommitInfo", "FORMAT_VERSION", "FileEntry", "METADATA_NAME", "Manifest",
                 "VersionHealth"),
    "retention_policy": ("Retention", "retention_plan"),
    "split_crc": ("buffer_crc32c", "crc32c_join", "file_crc32c"),
    "metadata_codec": ("FORMAT", "LEGACY_FORMAT", "ShardLocation", "decode_metadata",
                       "encode_metadata"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
