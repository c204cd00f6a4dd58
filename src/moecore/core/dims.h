// The dimension glossary: one meaning per letter, for every shape comment ("[N, H] f32") and dims struct in src/.
// Comments only. A size is this rank's share where a dims struct says so; Megatron's flag in parentheses.
//   B    sequences in a micro-batch (--micro-batch-size)
//   S    positions of each sequence on this rank: --seq-length, or --seq-length / CP under context parallelism
//   Sk   keys each query row attends over (S, more under context parallelism)
//   N    rows of the residual stream on this rank: B * S, or B * S / TP under sequence parallelism. Row-wise ops of
//        kernels/ (norms, activations, embedding, losses) call the rows they are given N
//   T    token rows of a block's GEMMs on this rank: B * S for attention and the dense MLP (all-gathered under SP);
//        the MoE layer, router and dispatchers work on the residual rows, so there T = N (t = s * B + b)
//   M    rows after permutation: routed (token, expert) pairs, the experts' input rows (T * K when dropless)
//   H    hidden size (--hidden-size)
//   F    MLP hidden size: the dense MLP's (--ffn-hidden-size) or a routed expert's (--moe-ffn-hidden-size); this
//        rank's F / TP (dense) or F / ETP (experts) where its struct says so
//   Fs   shared-expert hidden size (--moe-shared-expert-intermediate-size; 0: none)
//   V    vocabulary (padded); Vl = V / TP, this rank's vocabulary slice
//   E    routed experts, all of them (--num-experts); El = E / EP, the experts this rank holds; E' = E + ECHO slots
//   K    experts per token (--moe-router-topk)
//   C    expert capacity: rows kept per expert under token dropping (--moe-expert-capacity-factor)
//   G    query groups = key/value heads (--num-query-groups; G / TP on this rank)
//   R    query heads per group (heads = G * R)
//   D    head dim (--kv-channels); Dr the rotary channels (rope table [S, Dr]); MLA's dn, dr, dv, kvr: nn/mla.h
//   W    width of a packed row (qkv [B, S, W], W = G * (R + 2) * D)
//   L    transformer layers (--num-layers)
// Parallel sizes (the groups of parallel/process_groups.h):
//   TP   tensor parallel (P in nn/ and the vocabulary-parallel ops); SP is its sequence-parallel form
//   CP   context parallel; PP pipeline parallel; DP data parallel
//   EP   expert parallel; ETP expert tensor parallel (the MoE layer's own TP)
// Local letters that differ, each said where used:
//   GEMM ops use BLAS's M, N, K (c [M, N] = a [M, K] b [K, N]); the grouped GEMMs R rows in G groups;
//   MoE ECHO's planner (kernels/moe_echo_plan.h): P EP ranks, Sl slots per rank, S = P * Sl slots;
//   router-loss comments: P and f are Megatron's per-expert probability mass and token fraction, not sizes.
// Gradients are d<name> (dx, dw). Not here: any code; the dims structs live beside their modules.
#pragma once
