"""The `tenax.v1` wire contract: request/response messages and the JobService stubs.

The generated modules live in `proto/tenax/v1/` as `tenax.v1` because protoc writes imports
from the `.proto` path (`tenax/v1/jobs.proto`); this module is the face outsiders import.
"""
from tenax.v1 import jobs_pb2, jobs_pb2_grpc

__all__ = ["jobs_pb2", "jobs_pb2_grpc"]
