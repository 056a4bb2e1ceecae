"""Planted engine bugs: a transformers MLA model monkeypatched into the engine bugs issue #33 lists.

Each is a context manager over a loaded model (DeepSeek-V3's modeling module: interleaved rope, YaRN
mscale, q-LoRA); inside it the model computes wrongly in one place, the way a serving engine's MLA layer
has been seen to. `EXPECTED` says where `mla-diff run --capture` must name it: (layer, stage).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch


def _module(model):
    return sys.modules[type(model.model.layers[0].self_attn).__module__]


@contextlib.contextmanager
def _setattr(obj, name, value):
    had = name in vars(obj)
    old = getattr(obj, name, None)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def _setattr_each_attn(model, name, value_of):
    """`_setattr` on every layer's attention module, with the value `value_of(attn)`."""
    with contextlib.ExitStack() as stack:
        for layer in model.model.layers:
            stack.enter_context(_setattr(layer.self_attn, name, value_of(layer.self_attn)))
        yield


@contextlib.contextmanager
def rope_wrong_pairs(model):
    """Rope on the wrong pairs: the NeoX rotation (x[i], x[i+R/2]) applied to a file whose pairs are
    interleaved (x[2i], x[2i+1]) — `apply_rotary_pos_emb` where `…_interleave` belongs."""
    mod = _module(model)
    neox = mod.apply_rotary_pos_emb  # bound now: a capture wraps the module's names later

    def wrong(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return neox(q, k, cos, sin, unsqueeze_dim)

    with _setattr(mod, "apply_rotary_pos_emb_interleave", wrong):
        yield


@contextlib.contextmanager
def softmax_without_mscale(model):
    """Softmax scale 1/sqrt(d) without YaRN's mscale² (the engine forgot `yarn_apply_mscale`)."""
    with _setattr_each_attn(model, "scaling", lambda a: a.qk_head_dim ** -0.5):
        yield


@contextlib.contextmanager
def kv_b_split_swapped(model):
    """kv_b's output read as [all heads' k_nope | all heads' v] instead of per head [k_nope | v]."""
    def expand_kv_of(a):
        def expand_kv(kv_nope, k_rot):
            b, _, s, _ = kv_nope.shape
            h, p, v = a.num_heads, a.qk_nope_head_dim, a.v_head_dim
            kv = a.kv_b_proj(kv_nope)[:, 0]  # [B, S, H·(P+V)]
            k_nope = kv[..., : h * p].reshape(b, s, h, p).transpose(1, 2)
            value = kv[..., h * p:].reshape(b, s, h, v).transpose(1, 2)
            key = torch.cat([k_nope, k_rot.expand(-1, h, -1, -1)], dim=-1)
            return key, value.contiguous()
        return expand_kv

    with _setattr_each_attn(model, "expand_kv", expand_kv_of):
        yield


@contextlib.contextmanager
def k_pe_cached_before_rope(model):
    """The key's rope part written to the cache before rope: attention reads unrotated keys back."""
    from transformers import cache_utils

    mod = _module(model)
    rope = mod.apply_rotary_pos_emb_interleave
    local = threading.local()

    def rope_and_keep(q, k, *a, **kw):
        local.unroped = k
        return rope(q, k, *a, **kw)

    owner = next(c for c in cache_utils.DynamicCache.__mro__ if "update" in c.__dict__)
    update = owner.update

    def update_unroped(self, key_states, value_states, layer_idx, *a, **kw):
        un = getattr(local, "unroped", None)
        if un is not None and un.shape == value_states.shape:
            value_states = un  # the latent cache's "value" is the rope key (transformers 5's MLA cache)
        local.unroped = None
        return update(self, key_states, value_states, layer_idx, *a, **kw)

    with _setattr(mod, "apply_rotary_pos_emb_interleave", rope_and_keep), _setattr(owner, "update", update_unroped):
        yield


@contextlib.contextmanager
def chunk_context_dropped(model):
    """Chunked prefill whose later chunks attend only to themselves: the cached context is dropped
    (has_context ignored)."""
    mod = _module(model)
    eager = mod.eager_attention_forward

    def attend(module, q, k, v, mask, **kw):
        s = q.shape[2]
        if s > 1 and k.shape[2] > s:
            k, v = k[:, :, -s:], v[:, :, -s:]
            mask = None if mask is None else mask[..., -s:]
        return eager(module, q, k, v, mask, **kw)

    with _setattr(mod, "eager_attention_forward", attend):
        yield


@contextlib.contextmanager
def decode_position_off_by_one(model):
    """Decode steps roped at position + 1 (the engine's position counter runs one ahead)."""
    def pre(mod, args, kwargs):
        x = args[0] if args else kwargs["x"]
        pos = args[1] if len(args) > 1 else kwargs["position_ids"]
        if pos.shape[-1] == 1:
            return (x, pos + 1), {}
        return None

    h = model.model.rotary_emb.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        h.remove()


# bug → (layer, the stage `run --capture` must name first)
EXPECTED = {
    rope_wrong_pairs: (0, "q_pe"),
    softmax_without_mscale: (0, "attn_heads"),
    kv_b_split_swapped: (0, "attn_heads"),
    k_pe_cached_before_rope: (0, "cache_rows"),
    chunk_context_dropped: (0, "attn_heads"),
    decode_position_off_by_one: (0, "q_pe"),
}


def drive(model, ids, chunks, n_decode):
    """Chunked prefill of `ids` ([1, T]) in pieces of the given lengths, then `n_decode` greedy decode
    steps, all through one DynamicCache: the schedule a serving engine runs."""
    from transformers import DynamicCache

    assert sum(chunks) == ids.shape[1]
    cache = DynamicCache(config=model.config)
    at, out = 0, None
    with torch.no_grad():
        for c in chunks:
            out = model(input_ids=ids[:, at:at + c], cache=cache, use_cache=True)
            at += c
        for _ in range(n_decode):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, cache=cache, use_cache=True)
    return out
