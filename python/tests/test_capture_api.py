"""mla_diff.capture's API: what a tap writes, what it refuses, what it never touches. Plain unittest
(CI's venv has no pytest); tests/it/capture.rs runs it."""

import json
import os
import shutil
import struct
import tempfile
import unittest

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

import mla_diff
from mla_diff import capture

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "deepseek-v3-yarn-q4_k.gguf")

try:
    import torch
except ImportError:
    torch = None


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


class CaptureApi(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = os.path.join(self.tmp.name, "cap")

    def tearDown(self):
        self.tmp.cleanup()

    def session(self, **kw):
        return capture.session(self.dir, model_file=MODEL, engine="unit", **kw)

    def test_tap_without_a_session_does_nothing(self):
        self.assertIsNone(capture.active())
        capture.tap("q_pe", np.zeros((1, 2, 3)), layer=0)
        self.assertIsNone(capture.step("decode", [None]))

    def test_manifest_and_identity(self):
        with self.session() as s:
            r = s.request([5, 6, 7], prefill=2)
            s.step("prefill", [None, (r, 0), (r, 1)])
            capture.tap("x", np.ones((3, 4), np.float32), layer=3)
            s.step("decode", [(r, 2)])
            capture.tap("x", np.ones((1, 4), np.float32), layer=3)
        with open(os.path.join(self.dir, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual(m["format"], "mla-diff-capture")
        self.assertEqual(m["version"], 2)
        # The session's dtype is bf16 (the default); x was tapped in f32, and says so.
        self.assertEqual(m["stage_dtypes"], {"x": "f32"})
        self.assertEqual(m["model"], mla_diff.gguf_identity(MODEL))
        self.assertEqual(m["requests"], [{"id": 0, "tokens": [5, 6, 7], "positions": [0, 1, 2], "prefill": 2}])
        self.assertEqual(m["steps"][0]["rows"], [None, [0, 0], [0, 1]])
        self.assertEqual([(e["layer"], e["step"], e["file"]) for e in m["layers"]],
                         [(3, 0, "layer3/step0.safetensors"), (3, 1, "layer3/step1.safetensors")])

    def test_bf16_bits_are_kept(self):
        bits = np.array([0x3F80, 0x7FC1, 0x0001, 0x8000, 0xFF80, 0x4049], dtype=np.uint16)
        with self.session() as s:
            r = s.request([1, 2])
            s.step("prefill", [(r, 0), (r, 1)])
            capture.tap("lse", bits.reshape(2, 3).view(ml_dtypes.bfloat16), layer=0)
        path = os.path.join(self.dir, "layer0", "step0.safetensors")
        self.assertEqual(header(path)["lse"]["dtype"], "BF16")
        got = load_file(path)["lse"]
        np.testing.assert_array_equal(got.view(np.uint16).reshape(-1), bits)

    def test_the_source_is_copied_not_shared(self):
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        with self.session() as s:
            r = s.request([1, 2])
            s.step("prefill", [(r, 0), (r, 1)])
            capture.tap("lse", a, layer=0)
            a[:] = -1  # the engine reuses its buffer after the tap
            self.assertTrue((a == -1).all())
        got = load_file(os.path.join(self.dir, "layer0", "step0.safetensors"))["lse"]
        np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3))

    def test_refusals(self):
        with self.session() as s:
            r = s.request([1, 2])
            with self.assertRaisesRegex(capture.CaptureError, "no step started"):
                capture.tap("x", np.zeros((2, 4)), layer=0)
            s.step("prefill", [(r, 0), (r, 1)])
            with self.assertRaisesRegex(capture.CaptureError, "unknown stage 'q_rope'"):
                capture.tap("q_rope", np.zeros((2, 4)), layer=0)
            with self.assertRaisesRegex(capture.CaptureError, "the step has 2 rows"):
                capture.tap("x", np.zeros((3, 4)), layer=0)
            with self.assertRaisesRegex(capture.CaptureError, "must be integers"):
                capture.tap("topk", np.zeros((2, 4)), layer=0)
            with self.assertRaisesRegex(capture.CaptureError, "unknown request id 9"):
                s.step("decode", [(9, 2)])
            capture.tap("x", np.zeros((2, 4)), layer=0)
            with self.assertRaisesRegex(capture.CaptureError, "already has it"):
                capture.tap("x", np.zeros((2, 4)), layer=0)
        with self.assertRaisesRegex(capture.CaptureError, "already holds a capture"):
            capture.session(self.dir, model_file=MODEL)

    def test_an_engine_error_leaves_no_manifest(self):
        with self.assertRaises(RuntimeError):
            with self.session() as s:
                r = s.request([1])
                s.step("prefill", [(r, 0)])
                raise RuntimeError("engine crashed")
        self.assertFalse(os.path.exists(os.path.join(self.dir, "manifest.json")))
        self.assertIsNone(capture.active())

    def test_rows_merge(self):
        with self.session() as s:
            a = s.request([1, 2], prefill=1)
            b = s.request([3, 4], prefill=1)
            s.step("mixed", [(a, 0), (b, 1), None])
            capture.tap("attn_latent", np.full((1, 2, 3), 2.0, np.float32), layer=0, rows=[1])
            capture.tap("attn_latent", np.full((1, 2, 3), 1.0, np.float32), layer=0, rows=[0])
        got = load_file(os.path.join(self.dir, "layer0", "step0.safetensors"))
        np.testing.assert_array_equal(got["attn_latent.rows"], [1, 0])
        np.testing.assert_array_equal(got["attn_latent"][:, 0, 0], [2.0, 1.0])

    def test_stage_dtypes_are_each_tensors_own(self):
        """Each stage's storage type is its tensors' own (f16 cache rows next to f32 projections), the
        coarsest where taps differ, `dtype=` where the engine says; the session's dtype is not repeated;
        indices and f64 record none."""
        with self.session(dtype="f32") as s:
            r = s.request([1, 2], prefill=1)
            s.step("prefill", [(r, 0)])
            capture.tap("x", np.zeros((1, 4), np.float32), layer=0)
            capture.tap("kv_latent", np.zeros((1, 4), np.float64), layer=0)
            capture.tap("cache_rows", np.zeros((1, 6), np.float16), layer=0)
            capture.tap("attn_heads", np.zeros((1, 4), np.float32), layer=0, dtype="fp16")
            capture.tap("topk", np.zeros((1, 2), np.int32), layer=0)
            capture.tap("lse", np.zeros((1, 2), np.float16), layer=0)
            s.step("decode", [(r, 1)])
            capture.tap("lse", np.zeros((1, 2), ml_dtypes.bfloat16), layer=0)
        with open(os.path.join(self.dir, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual(m["stage_dtypes"], {"cache_rows": "fp16", "lse": "bf16", "attn_heads": "fp16"})
        # None differing from the session's dtype: no key (a version-1-shaped manifest).
        shutil.rmtree(self.dir)
        with self.session(dtype="fp16", stage_dtypes={"attn_out": "fp16"}) as s:
            r = s.request([1])
            s.step("prefill", [(r, 0)])
            capture.tap("cache_rows", np.zeros((1, 6), np.float16), layer=0)
        with open(os.path.join(self.dir, "manifest.json")) as f:
            self.assertNotIn("stage_dtypes", json.load(f))
        with self.assertRaisesRegex(capture.CaptureError, "stage_dtypes\\['topk'\\]: not a stage with values"):
            capture.session(os.path.join(self.tmp.name, "b"), model_file=MODEL, stage_dtypes={"topk": "f32"})
        with self.assertRaisesRegex(capture.CaptureError, "dtype must be one of"):
            with self.session(overwrite=True) as s:
                s.step("prefill", [(s.request([1]), 0)])
                capture.tap("x", np.zeros((1, 4), np.float32), layer=0, dtype="f8")

    @unittest.skipUnless(torch is not None, "torch not installed")
    def test_torch_bf16_is_copied_bit_for_bit(self):
        t = torch.randn(2, 3).to(torch.bfloat16)
        before = t.clone()
        with self.session() as s:
            r = s.request([1, 2])
            s.step("prefill", [(r, 0), (r, 1)])
            capture.tap("lse", t, layer=0)
        self.assertTrue(torch.equal(t, before))
        got = load_file(os.path.join(self.dir, "layer0", "step0.safetensors"))["lse"]
        np.testing.assert_array_equal(got.view(np.uint16), t.view(torch.int16).numpy().view(np.uint16))


if __name__ == "__main__":
    unittest.main()
