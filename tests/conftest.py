"""Keep every Ray and gloo endpoint of the test suite on 127.0.0.1 (before Ray is imported)."""
from tenax.orchestrator.loopback import loopback_env

loopback_env()
