from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Rules(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RULES_UNSPECIFIED: _ClassVar[Rules]
    RULES_CHAIN: _ClassVar[Rules]
    RULES_TREE_IID: _ClassVar[Rules]
    RULES_TREE_WITHOUT_REPLACEMENT: _ClassVar[Rules]

class TokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_KIND_UNSPECIFIED: _ClassVar[TokenKind]
    TOKEN_KIND_RECOVERED: _ClassVar[TokenKind]
    TOKEN_KIND_BONUS: _ClassVar[TokenKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
RULES_UNSPECIFIED: Rules
RULES_CHAIN: Rules
RULES_TREE_IID: Rules
RULES_TREE_WITHOUT_REPLACEMENT: Rules
TOKEN_KIND_UNSPECIFIED: TokenKind
TOKEN_KIND_RECOVERED: TokenKind
TOKEN_KIND_BONUS: TokenKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("request_id", "cycle", "token_ids", "parents", "draft_probs", "draft_probs_dtype", "rules", "probe_token_ids", "probe_parents")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    PROBE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cycle: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    draft_probs_dtype: str
    rules: Rules
    probe_token_ids: _containers.RepeatedScalarFieldContainer[int]
    probe_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., cycle: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., draft_probs_dtype: _Optional[str] = ..., rules: _Optional[_Union[Rules, str]] = ..., probe_token_ids: _Optional[_Iterable[int]] = ..., probe_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("request_id", "cycle", "accepted_path", "next_token", "next_kind", "committed_length", "finish_reason", "target_seconds", "allreduce_seconds", "features", "batch_size", "step_positions", "probe_argmax", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_KIND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PROBE_ARGMAX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cycle: int
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    next_kind: TokenKind
    committed_length: int
    finish_reason: FinishReason
    target_seconds: float
    allreduce_seconds: float
    features: Tensor
    batch_size: int
    step_positions: int
    probe_argmax: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., cycle: _Optional[int] = ..., accepted_path: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ..., next_kind: _Optional[_Union[TokenKind, str]] = ..., committed_length: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., target_seconds: _Optional[float] = ..., allreduce_seconds: _Optional[float] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., batch_size: _Optional[int] = ..., step_positions: _Optional[int] = ..., probe_argmax: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
