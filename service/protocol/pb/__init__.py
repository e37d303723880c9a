"""Protobuf and gRPC modules generated from protos/ (``make protos``); none is written by hand.

Their descriptors live in :data:`POOL`, not in protobuf's default pool: tritonclient and KServe's
SDK register the same ``inference.*`` names there, and one process may hold either of them.
"""

from google.protobuf.descriptor_pool import DescriptorPool

POOL = DescriptorPool()
