"""The wire between drafter and target: protobuf messages (protos/specserve/v1) and their codec.

The gRPC services around them come with the distributed runtime (issue 3).
"""
