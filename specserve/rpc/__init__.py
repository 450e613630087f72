"""The wire between drafter and target: protobuf messages (protos/specserve/v1), their codec and the gRPC service.

:mod:`specserve.rpc.codec` turns proposals and the target's cycle outcomes into messages and back,
validating everything received; :mod:`specserve.rpc.verifier` carries them over the
``specserve.v1.Verifier`` stream. Only this package encodes protobuf.
"""
