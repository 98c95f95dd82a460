"""Tinker's wire messages, read and written with the `tinker` SDK's own generated protobuf module
(`tinker.proto.tinker_public_pb2`: a dependency, never a re-declared schema). Forward-backward
requests arrive as protobuf; forward-backward and sample results leave as protobuf (the SDK
refuses JSON for them); everything else is JSON (server.py).

    decode_forward_backward(body)  -> ForwardBackward (datums as tensors)
    forward_backward_output(...)   -> bytes (per-datum `logprobs`, metrics `name:reduction`)
    sample_response(...)           -> bytes (tokens, log-probs, stop reasons, prompt log-probs)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from posttrain.util.errors import ConfigError


def pb():
    """The SDK's generated module (imported on first use: `pip install -e ".[tinker]"`)."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:
        raise ConfigError('posttrain tinker-serve needs the tinker SDK: pip install -e ".[tinker]"') from e
    return tinker_public_pb2


NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}   # DType: FLOAT32, INT64, INT32


class WireError(ValueError):
    """A request the server cannot read: the client's error (answered as category "user")."""


@dataclass
class Datum:
    tokens: list[int]                       # the model input, every chunk's tokens in order
    inputs: dict[str, Tensor] = field(default_factory=dict)   # loss_fn_inputs, one per position


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    config: dict[str, float]
    data: list[Datum]


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """A `ForwardBackwardRequest` (zstd already undone by the server) as tensors."""
    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:   # (protobuf's DecodeError: not a message of this type)
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest ({e})") from e
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
        elif v.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config {k!r} is text ({v.text!r}): server-side custom "
                            "losses are not served (forward_backward_custom runs client-side)")
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, bool(msg.forward_only),
                           config, [_datum(d) for d in msg.data])


def _datum(d) -> Datum:
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"a datum's model input has a {kind} chunk: only text (token ids) is "
                            "served; the base models here read no images or audio")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    return Datum(tokens, {name: tensor(t, name) for name, t in d.loss_fn_inputs.items()})


def tensor(t, name: str) -> Tensor:
    """A protobuf `Tensor` (dense, or sparse CSR with zeros elsewhere) as a torch tensor."""
    if t.dtype not in NUMPY:
        raise WireError(f"loss_fn_inputs {name!r} has dtype {t.dtype}: float32 or int64 are served")
    dtype = NUMPY[t.dtype]
    shape = list(t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        csr = t.sparse_csr
        return torch.sparse_csr_tensor(
            torch.from_numpy(np.frombuffer(csr.crow_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.col_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.values, dtype=dtype).copy()), size=shape).to_dense()
    values = torch.from_numpy(np.frombuffer(t.dense, dtype=dtype).copy())
    return values.reshape(shape) if shape else values


def forward_backward_output(logprobs: list[Tensor], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: one ArrayRecord whose field `logprobs` holds each datum's
    target-token log-probs (float32, byte offsets per datum), and the metrics."""
    m = pb()
    out = m.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    arrays = [lp.detach().to(torch.float32).reshape(-1).numpy() for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    record = out.loss_fn_outputs.add(num_datums=len(arrays))
    record.fields["logprobs"].CopyFrom(m.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=1))
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool                  # True: EOS or a stop sequence; False: max_tokens


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """A `SampleResponse`: each sequence's int32 tokens, float32 log-probs and stop reason
    (STOP 0, LENGTH 1); the prompt's log-probs with NaN where none is computed (position 0)."""
    m = pb()
    out = m.SampleResponse()
    for s in sequences:
        out.sequences.add(stop_reason=0 if s.stopped else 1,
                          tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
