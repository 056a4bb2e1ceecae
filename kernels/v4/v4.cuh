// v4/v4.cuh — DeepSeek-V4's index arithmetic (docs/deepseek-v4.md, steps 5–7), shared by its kernels in
// kernels/v4/ and restated on the host by src/backend/cuda/v4/plan.rs (whose tests hold it to the CPU
// mirror's compressor state machine, src/backend/cpu/v4/compress.rs).
//
// Positions are 0..T. A compressor of ratio m closes entry w when the last token of its window arrives;
// query t sees the window rows of the last sliding_window positions up to itself and the entries closed
// at or before it.
//
// Planted bugs (src/faults.rs; compiled in as -D MLA_FAULT_…=1 for a layer they target):
//   MLA_FAULT_WINDOW_OFF_BY_ONE          sliding_window past rows plus the query's own (one past the edge)
//   MLA_FAULT_COMPRESS_GROUP_OFF_BY_ONE  the groups start one token early: token t in slot (t + 1) % m
//   MLA_FAULT_COMPRESSOR_STATE_DROPPED   a forward pass pools only its own tokens: the unclosed window's
//                                        tokens and CSA's previous-window half from earlier passes dropped
#pragma once

#ifdef MLA_FAULT_COMPRESS_GROUP_OFF_BY_ONE
#define V4_GROUP_SHIFT 1
#else
#define V4_GROUP_SHIFT 0
#endif

// The first window row query t sees: sliding_window − 1 past rows and its own.
__device__ __forceinline__ int v4_window_start(int t, int window) {
#ifdef MLA_FAULT_WINDOW_OFF_BY_ONE
    const int past = window;
#else
    const int past = window - 1;
#endif
    return max(t - past, 0);
}

// The token that closes entry w (the last of its window).
__device__ __forceinline__ int v4_close(int w, int m) { return (w + 1) * m - 1 - V4_GROUP_SHIFT; }

// The first token of entry w's window (the first window is one token short under the group shift).
__device__ __forceinline__ int v4_first(int w, int m) { return max(w * m - V4_GROUP_SHIFT, 0); }

// Token t's slot in its window (its ape row).
__device__ __forceinline__ int v4_slot(int t, int m) { return (t + V4_GROUP_SHIFT) % m; }

// How many entries query t sees: those closed at or before it.
__device__ __forceinline__ int v4_visible(int t, int m) { return (t + 1 + V4_GROUP_SHIFT) / m; }

// The first token a compressor still holds in a forward pass starting at pass_start (its carried state).
__device__ __forceinline__ int v4_state_from(int pass_start) {
#ifdef MLA_FAULT_COMPRESSOR_STATE_DROPPED
    return pass_start;
#else
    (void)pass_start;
    return 0;
#endif
}
