from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TopKForm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOPK_FORM_UNSPECIFIED: _ClassVar[TopKForm]
    TOPK_FORM_LOGPROBS: _ClassVar[TopKForm]
TOPK_FORM_UNSPECIFIED: TopKForm
TOPK_FORM_LOGPROBS: TopKForm

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TeacherInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "hidden_size", "num_layers", "dtype", "device_type", "tp_size", "max_batch_tokens", "max_seq_len", "max_sessions", "max_inflight", "tokenizer_fingerprint", "torch_version", "nccl_version", "head", "attention", "max_score_ids", "quantization", "topk_form", "weights_fingerprint")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    NCCL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TOPK_FORM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str
    device_type: str
    tp_size: int
    max_batch_tokens: int
    max_seq_len: int
    max_sessions: int
    max_inflight: int
    tokenizer_fingerprint: str
    torch_version: str
    nccl_version: str
    head: OutputHeadInfo
    attention: AttentionInputsInfo
    max_score_ids: int
    quantization: QuantizationInfo
    topk_form: TopKForm
    weights_fingerprint: str
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., tp_size: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_inflight: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., torch_version: _Optional[str] = ..., nccl_version: _Optional[str] = ..., head: _Optional[_Union[OutputHeadInfo, _Mapping]] = ..., attention: _Optional[_Union[AttentionInputsInfo, _Mapping]] = ..., max_score_ids: _Optional[int] = ..., quantization: _Optional[_Union[QuantizationInfo, _Mapping]] = ..., topk_form: _Optional[_Union[TopKForm, str]] = ..., weights_fingerprint: _Optional[str] = ...) -> None: ...

class QuantizationInfo(_message.Message):
    __slots__ = ("format", "scaling", "source", "full_precision_layers", "fast_accumulation", "full_precision_linears", "bias_correction", "fp8_flop_share", "calibration_tokens", "kl_mean", "kl_p99", "top1_agreement", "max_kl")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FULL_PRECISION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FAST_ACCUMULATION_FIELD_NUMBER: _ClassVar[int]
    FULL_PRECISION_LINEARS_FIELD_NUMBER: _ClassVar[int]
    BIAS_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    FP8_FLOP_SHARE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KL_MEAN_FIELD_NUMBER: _ClassVar[int]
    KL_P99_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_KL_FIELD_NUMBER: _ClassVar[int]
    format: str
    scaling: str
    source: str
    full_precision_layers: _containers.RepeatedScalarFieldContainer[int]
    fast_accumulation: bool
    full_precision_linears: _containers.RepeatedScalarFieldContainer[str]
    bias_correction: bool
    fp8_flop_share: float
    calibration_tokens: int
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    max_kl: float
    def __init__(self, format: _Optional[str] = ..., scaling: _Optional[str] = ..., source: _Optional[str] = ..., full_precision_layers: _Optional[_Iterable[int]] = ..., fast_accumulation: _Optional[bool] = ..., full_precision_linears: _Optional[_Iterable[str]] = ..., bias_correction: _Optional[bool] = ..., fp8_flop_share: _Optional[float] = ..., calibration_tokens: _Optional[int] = ..., kl_mean: _Optional[float] = ..., kl_p99: _Optional[float] = ..., top1_agreement: _Optional[float] = ..., max_kl: _Optional[float] = ...) -> None: ...

class OutputHeadInfo(_message.Message):
    __slots__ = ("bias", "final_logit_softcapping", "logit_scale", "unavailable")
    BIAS_FIELD_NUMBER: _ClassVar[int]
    FINAL_LOGIT_SOFTCAPPING_FIELD_NUMBER: _ClassVar[int]
    LOGIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    bias: bool
    final_logit_softcapping: float
    logit_scale: float
    unavailable: str
    def __init__(self, bias: _Optional[bool] = ..., final_logit_softcapping: _Optional[float] = ..., logit_scale: _Optional[float] = ..., unavailable: _Optional[str] = ...) -> None: ...

class AttentionInputsInfo(_message.Message):
    __slots__ = ("query_width", "key_width", "value_width", "unavailable")
    QUERY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    VALUE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    query_width: int
    key_width: int
    value_width: int
    unavailable: str
    def __init__(self, query_width: _Optional[int] = ..., key_width: _Optional[int] = ..., value_width: _Optional[int] = ..., unavailable: _Optional[str] = ...) -> None: ...

class OutputSpec(_message.Message):
    __slots__ = ("logits", "topk", "hidden_layers", "dtype", "final_hidden", "attention_layers", "logit_subset", "aux_hidden_states", "argmax", "next_token_logprobs", "score_ids", "logprob_temperature", "cross_tokenizer")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FINAL_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_SUBSET_FIELD_NUMBER: _ClassVar[int]
    AUX_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CROSS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    logits: bool
    topk: int
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    final_hidden: bool
    attention_layers: _containers.RepeatedScalarFieldContainer[int]
    logit_subset: Tensor
    aux_hidden_states: AuxHiddenStates
    argmax: bool
    next_token_logprobs: bool
    score_ids: int
    logprob_temperature: float
    cross_tokenizer: CrossTokenizerOutputs
    def __init__(self, logits: _Optional[bool] = ..., topk: _Optional[int] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., final_hidden: _Optional[bool] = ..., attention_layers: _Optional[_Iterable[int]] = ..., logit_subset: _Optional[_Union[Tensor, _Mapping]] = ..., aux_hidden_states: _Optional[_Union[AuxHiddenStates, _Mapping]] = ..., argmax: _Optional[bool] = ..., next_token_logprobs: _Optional[bool] = ..., score_ids: _Optional[int] = ..., logprob_temperature: _Optional[float] = ..., cross_tokenizer: _Optional[_Union[CrossTokenizerOutputs, _Mapping]] = ...) -> None: ...

class CrossTokenizerOutputs(_message.Message):
    __slots__ = ("span_logprobs", "projected", "projected_rest_topk", "sorted_topk", "projected_by_prefix")
    SPAN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_REST_TOPK_FIELD_NUMBER: _ClassVar[int]
    SORTED_TOPK_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_BY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    span_logprobs: bool
    projected: bool
    projected_rest_topk: int
    sorted_topk: int
    projected_by_prefix: bool
    def __init__(self, span_logprobs: _Optional[bool] = ..., projected: _Optional[bool] = ..., projected_rest_topk: _Optional[int] = ..., sorted_topk: _Optional[int] = ..., projected_by_prefix: _Optional[bool] = ...) -> None: ...

class StudentVocabulary(_message.Message):
    __slots__ = ("token_bytes", "token_lengths")
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    token_bytes: bytes
    token_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_bytes: _Optional[bytes] = ..., token_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class VocabularyAlignment(_message.Message):
    __slots__ = ("matched_student_ids", "student_vocab_size")
    MATCHED_STUDENT_IDS_FIELD_NUMBER: _ClassVar[int]
    STUDENT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    matched_student_ids: Tensor
    student_vocab_size: int
    def __init__(self, matched_student_ids: _Optional[_Union[Tensor, _Mapping]] = ..., student_vocab_size: _Optional[int] = ...) -> None: ...

class RowTexts(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rows: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AuxHiddenStates(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layers: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("device_type", "device_uuid", "torch_version", "nccl_version")
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    NCCL_VERSION_FIELD_NUMBER: _ClassVar[int]
    device_type: str
    device_uuid: str
    torch_version: str
    nccl_version: str
    def __init__(self, device_type: _Optional[str] = ..., device_uuid: _Optional[str] = ..., torch_version: _Optional[str] = ..., nccl_version: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "job_rank", "outputs", "peer", "max_inflight", "tokenizer_fingerprint", "vocab_size", "weight", "stream_refusals_only", "job_size", "student_vocabulary")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_RANK_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STREAM_REFUSALS_ONLY_FIELD_NUMBER: _ClassVar[int]
    JOB_SIZE_FIELD_NUMBER: _ClassVar[int]
    STUDENT_VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_rank: int
    outputs: OutputSpec
    peer: PeerInfo
    max_inflight: int
    tokenizer_fingerprint: str
    vocab_size: int
    weight: float
    stream_refusals_only: bool
    job_size: int
    student_vocabulary: StudentVocabulary
    def __init__(self, job_id: _Optional[str] = ..., job_rank: _Optional[int] = ..., outputs: _Optional[_Union[OutputSpec, _Mapping]] = ..., peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., max_inflight: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., weight: _Optional[float] = ..., stream_refusals_only: _Optional[bool] = ..., job_size: _Optional[int] = ..., student_vocabulary: _Optional[_Union[StudentVocabulary, _Mapping]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("session_id", "info", "backend", "timeout_s", "heartbeat_interval_s", "lease_s", "max_inflight", "output_dtype", "stream_refusals_only", "data_plane_host", "session_secret", "alignment")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STREAM_REFUSALS_ONLY_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_HOST_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    info: TeacherInfo
    backend: str
    timeout_s: float
    heartbeat_interval_s: float
    lease_s: float
    max_inflight: int
    output_dtype: str
    stream_refusals_only: bool
    data_plane_host: str
    session_secret: str
    alignment: VocabularyAlignment
    def __init__(self, session_id: _Optional[str] = ..., info: _Optional[_Union[TeacherInfo, _Mapping]] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., lease_s: _Optional[float] = ..., max_inflight: _Optional[int] = ..., output_dtype: _Optional[str] = ..., stream_refusals_only: _Optional[bool] = ..., data_plane_host: _Optional[str] = ..., session_secret: _Optional[str] = ..., alignment: _Optional[_Union[VocabularyAlignment, _Mapping]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("session_id", "batch_id", "input_ids", "attention_mask", "score_ids", "student_text")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    STUDENT_TEXT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    batch_id: int
    input_ids: Tensor
    attention_mask: Tensor
    score_ids: Tensor
    student_text: RowTexts
    def __init__(self, session_id: _Optional[str] = ..., batch_id: _Optional[int] = ..., input_ids: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., score_ids: _Optional[_Union[Tensor, _Mapping]] = ..., student_text: _Optional[_Union[RowTexts, _Mapping]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("batch_id", "inflight", "error_code", "error_message", "events")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    inflight: int
    error_code: int
    error_message: str
    events: BatchEvents
    def __init__(self, batch_id: _Optional[int] = ..., inflight: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., events: _Optional[_Union[BatchEvents, _Mapping]] = ...) -> None: ...

class BatchEvents(_message.Message):
    __slots__ = ("announced", "failed")
    ANNOUNCED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    announced: _containers.RepeatedScalarFieldContainer[int]
    failed: _containers.RepeatedCompositeFieldContainer[BatchFailure]
    def __init__(self, announced: _Optional[_Iterable[int]] = ..., failed: _Optional[_Iterable[_Union[BatchFailure, _Mapping]]] = ...) -> None: ...

class BatchFailure(_message.Message):
    __slots__ = ("batch_id", "reason")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    reason: str
    def __init__(self, batch_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("session_id", "op", "keys", "value", "expected", "amount", "wait_s")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[RendezvousRequest.Op]
        SET: _ClassVar[RendezvousRequest.Op]
        GET: _ClassVar[RendezvousRequest.Op]
        ADD: _ClassVar[RendezvousRequest.Op]
        CHECK: _ClassVar[RendezvousRequest.Op]
        WAIT: _ClassVar[RendezvousRequest.Op]
        DELETE: _ClassVar[RendezvousRequest.Op]
        COMPARE_SET: _ClassVar[RendezvousRequest.Op]
        NUM_KEYS: _ClassVar[RendezvousRequest.Op]
    OP_UNSPECIFIED: RendezvousRequest.Op
    SET: RendezvousRequest.Op
    GET: RendezvousRequest.Op
    ADD: RendezvousRequest.Op
    CHECK: RendezvousRequest.Op
    WAIT: RendezvousRequest.Op
    DELETE: RendezvousRequest.Op
    COMPARE_SET: RendezvousRequest.Op
    NUM_KEYS: RendezvousRequest.Op
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    op: RendezvousRequest.Op
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    wait_s: float
    def __init__(self, session_id: _Optional[str] = ..., op: _Optional[_Union[RendezvousRequest.Op, str]] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("found", "value", "number")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    number: int
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., number: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("batches_sent", "inflight")
    BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    batches_sent: int
    inflight: int
    def __init__(self, batches_sent: _Optional[int] = ..., inflight: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("session_id", "drain")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    drain: bool
    def __init__(self, session_id: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("batches_sent",)
    BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    batches_sent: int
    def __init__(self, batches_sent: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "job_id", "job_rank", "backend", "state", "batches_submitted", "batches_sent", "tokens_served", "bytes_sent", "inflight", "last_heartbeat_age_s", "weight")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_id: str
    job_rank: int
    backend: str
    state: str
    batches_submitted: int
    batches_sent: int
    tokens_served: int
    bytes_sent: int
    inflight: int
    last_heartbeat_age_s: float
    weight: float
    def __init__(self, session_id: _Optional[str] = ..., job_id: _Optional[str] = ..., job_rank: _Optional[int] = ..., backend: _Optional[str] = ..., state: _Optional[str] = ..., batches_submitted: _Optional[int] = ..., batches_sent: _Optional[int] = ..., tokens_served: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., inflight: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., weight: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("info", "sessions", "busy_fraction", "queue_depth", "sessions_total", "held_bytes", "held_bytes_limit", "weight_total")
    INFO_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    info: TeacherInfo
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    busy_fraction: float
    queue_depth: int
    sessions_total: int
    held_bytes: int
    held_bytes_limit: int
    weight_total: float
    def __init__(self, info: _Optional[_Union[TeacherInfo, _Mapping]] = ..., sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ..., busy_fraction: _Optional[float] = ..., queue_depth: _Optional[int] = ..., sessions_total: _Optional[int] = ..., held_bytes: _Optional[int] = ..., held_bytes_limit: _Optional[int] = ..., weight_total: _Optional[float] = ...) -> None: ...
