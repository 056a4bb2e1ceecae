"""mla_diff.capture.sglang's wrappers over a stand-in of SGLang 0.5.23's call structure.

SGLang needs a GPU, so it is not run here (test_engine_targets.py checks the wrapped functions against
the wheel's source). This stand-in has the same classes, methods and parameters, and its attention
boundary does what `StageBoundary._prepare_attention` does with a `capture` callback (read in the
wheel): the embeddings go to the callback at the first layer, the residual the fused add+norm wrote
(the layer input) at every other, and the normed value goes on to the attention. The test checks that
the capture's `x` is that layer input — not the normed value, not the previous layer's — for each
layer and step, that a callback the engine passed still runs, and that `close()` restores SGLang.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO

torch = pytest.importorskip("torch")

MODEL = REPO / "fixtures" / "deepseek-v3-yarn-q4_k.gguf"

STAND_IN = {
    "sglang/__init__.py": '__version__ = "0.5.23+stand-in"\n',
    "sglang/srt/__init__.py": "",
    "sglang/srt/distributed/__init__.py": """
        WORLD = 1

        def get_tensor_model_parallel_world_size():
            return WORLD

        def get_tensor_model_parallel_rank():
            return 0
    """,
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/layers/layer_boundary/__init__.py": "",
    "sglang/srt/layers/layer_boundary/stage.py": """
        class Stream:
            def __init__(self):
                self.residual = None

        class StageBoundary:
            def prepare(self, hidden_states, forward_batch, *, cache=None, **call):
                return self._prepare_attention(hidden_states, forward_batch.stream, forward_batch, **call)

            def _prepare_attention(self, hidden_states, stream, forward_batch, capture_gathered=None,
                                   post_residual_addition=None, quant_format="", capture=None,
                                   read_context=None):
                first = stream.residual is None
                if capture is not None and first:
                    capture(hidden_states)
                stream.residual = hidden_states if first else hidden_states + stream.residual
                if capture is not None and not first:
                    capture(stream.residual, owned=False)
                return stream.residual * 0.5          # the norm, as far as the test cares
    """,
    "sglang/srt/models/__init__.py": "",
    "sglang/srt/models/deepseek_common/__init__.py": "",
    "sglang/srt/models/deepseek_common/attention_forward_methods/__init__.py": "",
    "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py": """
        class DeepseekMLAForwardMixin:
            def forward_absorb_core(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch):
                return q_nope_out.sum(-1)
    """,
    "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py": """
        class DeepseekMHAForwardMixin:
            def forward_normal_core(self, q, k, v, forward_batch):
                return q
    """,
    "sglang/srt/models/deepseek_v2.py": """
        import torch
        from sglang.srt.layers.layer_boundary.stage import StageBoundary
        from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla import DeepseekMLAForwardMixin

        class DeepseekV2AttentionMLA(DeepseekMLAForwardMixin):
            def __init__(self, layer_id):
                self.layer_id = layer_id

            def forward(self, positions, hidden_states, forward_batch, zero_allocator):
                n = hidden_states.shape[0]
                o = self.forward_absorb_core(torch.ones(n, 2, 4), torch.ones(n, 1, 4), torch.ones(n, 2, 8),
                                             torch.ones(n, 1, 8), forward_batch)
                return hidden_states + o.sum(-1, keepdim=True)

        class DeepseekV2DecoderLayer:
            def __init__(self, layer_id):
                self.layer_id = layer_id
                self.attn_boundary = StageBoundary()
                self.self_attn = DeepseekV2AttentionMLA(layer_id)
                self.engine_capture = None     # as other SGLang models pass EAGLE3's aux capture

            def forward(self, positions, hidden_states, forward_batch, zero_allocator):
                own = {} if self.engine_capture is None else {"capture": self.engine_capture}
                h = self.attn_boundary.prepare(hidden_states, forward_batch, capture_gathered=None, **own)
                return self.self_attn.forward(positions, h, forward_batch, zero_allocator) - h
    """,
}


class Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_decode(self):
        return self.decode


class Batch:
    """The ForwardBatch fields the capture reads, plus the stand-in's residual stream."""

    def __init__(self, decode, reqs, ids, pos, lens):
        from sglang.srt.layers.layer_boundary.stage import Stream

        self.forward_mode = Mode(decode)
        self.req_pool_indices = torch.tensor(reqs)
        self.input_ids = torch.tensor(ids)
        self.positions = torch.tensor(pos)
        self.extend_seq_lens_cpu = lens
        self.stream = Stream()


@pytest.fixture()
def sglang(tmp_path, monkeypatch):
    for rel, text in STAND_IN.items():
        p = tmp_path / "site" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


def run_model(layers, batch, x0):
    """Two stand-in layers over one batch; returns what each layer's boundary saw as its input."""
    inputs, h = [], x0
    for layer in layers:
        stream = batch.stream
        before = None if stream.residual is None else stream.residual.clone()
        inputs.append(h.clone() if before is None else h + before)
        h = layer.forward(batch.positions, h, batch, None)
    return inputs


def test_x_is_each_layers_input_and_the_wrappers_come_off(sglang, tmp_path, monkeypatch):
    from mla_diff.capture import sglang as scap
    from sglang.srt.layers.layer_boundary.stage import StageBoundary
    from sglang.srt.models import deepseek_v2

    original = StageBoundary.__dict__["_prepare_attention"]
    seen = []
    layers = [deepseek_v2.DeepseekV2DecoderLayer(i) for i in range(2)]
    # As SGLang's plugin loader calls it in each of its processes.
    monkeypatch.setenv("MLA_DIFF_CAPTURE_DIR", str(tmp_path / "cap"))
    monkeypatch.setenv("MLA_DIFF_CAPTURE_MODEL", str(MODEL))
    monkeypatch.setenv("MLA_DIFF_CAPTURE_DTYPE", "f32")
    scap.plugin()
    try:
        prefill = Batch(False, [7, 3], [11, 12, 13, 21, 22], [0, 1, 2, 0, 1], [3, 2])
        g = torch.Generator().manual_seed(0)
        want_prefill = run_model(layers, prefill, torch.randn(5, 6, generator=g))
        decode = Batch(True, [7, 3], [14, 23], [3, 2], None)
        want_decode = run_model(layers, decode, torch.randn(2, 6, generator=g))
        # A layer that passes a capture of its own: both callbacks get the layer input.
        third = Batch(True, [7, 3], [15, 24], [4, 3], None)
        x0 = torch.randn(2, 6, generator=g)
        h = layers[0].forward(third.positions, x0, third, None)
        want_third_1 = h + third.stream.residual
        layers[1].engine_capture = lambda v, owned=False: seen.append(v.clone())
        layers[1].forward(third.positions, h, third, None)
    finally:
        scap.close()

    assert StageBoundary.__dict__["_prepare_attention"] is original, "close() must restore SGLang"
    assert len(seen) == 1 and torch.equal(seen[0], want_third_1)
    cap = tmp_path / "cap"
    for step, want in enumerate([want_prefill, want_decode]):
        for layer in range(2):
            got = load_file(str(cap / f"layer{layer}" / f"step{step}.safetensors"))
            np.testing.assert_array_equal(got["x"], want[layer].numpy(), err_msg=f"layer {layer} step {step}")
            assert "attn_in" in got and not np.array_equal(got["x"], got["attn_in"])
    got = load_file(str(cap / "layer1" / "step2.safetensors"))
    np.testing.assert_array_equal(got["x"], want_third_1.numpy())


def test_a_process_that_runs_no_layer_writes_nothing_and_tp_is_refused(sglang, tmp_path):
    from mla_diff.capture import CaptureError
    from mla_diff.capture import sglang as scap
    from sglang.srt import distributed
    from sglang.srt.models import deepseek_v2

    scap.install(tmp_path / "main", model_file=str(MODEL))   # SGLang's main process: no layer runs
    scap.close()
    assert not (tmp_path / "main").exists()

    distributed.WORLD = 2
    scap.install(tmp_path / "tp", model_file=str(MODEL))
    try:
        with pytest.raises(CaptureError, match="TP 1 only"):
            deepseek_v2.DeepseekV2DecoderLayer(0).forward(None, torch.zeros(1, 6), Batch(True, [0], [5], [0], None), None)
    finally:
        scap.close()
