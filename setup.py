"""One import package, `tenax`, from the repository's role folders.

The folders keep their places (`orchestrator/`, `workers/`, `checkpoint/`, `parallel/`, and the
generated gRPC modules under `proto/tenax/v1/`); `package_dir` maps each one under `tenax`, so an
install adds the single top-level name `tenax` and no generic one such as `checkpoint`. The
package list is computed because every sub-package of a mapped folder must be named.
"""
from setuptools import find_packages, setup

ROLES = ("orchestrator", "workers", "checkpoint", "parallel")

packages = ["tenax", "tenax.v1"] + [f"tenax.{p}" for p in find_packages(where="tenax")]
package_dir = {"tenax": "tenax", "tenax.v1": "proto/tenax/v1"}
for role in ROLES:
    packages += [f"tenax.{p}" for p in find_packages(include=[role, f"{role}.*"])]
    package_dir[f"tenax.{role}"] = role

setup(packages=packages, package_dir=package_dir)
