"""Mixture of experts: what one MoE layer costs on one GPU for one microbatch. Pure functions.

A MoE layer in Megatron (megatron-core's ``MoELayer``: route -> permute -> dispatch -> experts ->
combine -> unpermute) costs, forward + backward, on the GPU whose experts got the most tokens:

router      the (T x h) @ (h x E) gating GEMM, the fp32 score / top-k / aux-loss kernels over
            T x E, and a launch cost of those small kernels that grows with E (fitted);
permute     gathering each token's k copies by expert before the dispatch and scattering them
            back (weighted by the router probabilities) after the combine, forward and backward:
            memory-bound traffic of `moe_permute_passes` x (T·k·h) activations, plus a launch
            cost per layer and one per local expert (the alltoall dispatcher's local re-sort of
            chunks by expert; fused away by Transformer Engine's permutation kernels);
dispatch    the all-to-all (or all-gather / reduce-scatter) of the tokens over the EP group,
            twice forward (dispatch, combine) and twice backward, on NVLink or the network
            depending on where the group lands (``step_time.group_link``), busiest rank first,
            of which `moe_a2a_exposed` is not hidden behind compute;
experts     the local experts' fc1 / activation / fc2 as grouped GEMMs whose efficiency grows with
            the tokens per expert (T·k·EP·ETP / E: `moe_gemm_half_tokens`), times the load
            imbalance of the busiest EP rank; with one GEMM per expert (megatron-core's
            SequentialMLP, grouped GEMM off) the host launches each expert's ~20 kernels in turn
            and the phase takes at least E_local x `moe_sequential_expert_s`;
shared      shared experts: a dense MLP of the shared size on every token (TP-sharded).

Load imbalance: the busiest of the EP ranks sets the pace. A rank's load (token-expert pairs)
has a statistical spread (multinomial routing: cv = 1/sqrt(pairs per rank), checked against the
tokens per expert the runner recorded with forced-balanced routing) and, for a router trained
with the auxiliary loss, an excess whose busiest expert carries `moe_router_skew` more than the
mean; the expected maximum of EP ranks is mean x (1 + z_EP x cv), z_n the expected largest of n
standard normal draws (``expected_max_normal``, Blom's approximation: 0.56 at n = 2, 1.03 at 4,
1.42 at 8; the asymptotic sqrt(2 ln n) overstates it at small n: 1.18, 1.67, 2.04).

Memory: the MoE activations per routed token (permuted input and expert output, fc1 output, the
activation and its probability-weighted copy), the router's fp32 tensors, shared experts; expert
weights and their optimizer states are sharded over EP x ETP and expert-DP in ``memory.py``.
"""
from __future__ import annotations

import functools
import math
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants

# TE's sort_chunks_by_index (fused permutation, alltoall dispatcher, EP > 1, several local experts):
# 2 calls forward (after the dispatch, before the combine) and their 2 backward, each reading and
# writing the routed tokens once: 8 passes over T·k·h beside the permute / unpermute ones
SORT_CHUNKS_PASSES = 8.0

# The per-term times `predict --json` shows in its breakdown (seconds per step, slowest stage).
TERMS = ("moe_router_s", "moe_permute_s", "moe_dispatch_s", "moe_expert_gemm_s")


@dataclass
class MoELayerTime:
    """Seconds for one MoE layer, one microbatch, forward + backward, on the busiest GPU.

    The four terms (and ``shared``) are what the runner times on its own (runners/moe_probe.py);
    ``gemm``, ``memory_bound``, ``comm`` and ``overhead`` split the same seconds into the step
    model's categories (GEMMs, HBM-bound kernels, exposed communication, host-side launch cost)."""

    router: float = 0.0
    permute: float = 0.0
    dispatch: float = 0.0  # exposed (after overlap)
    expert: float = 0.0
    shared: float = 0.0
    gemm: float = 0.0
    memory_bound: float = 0.0
    comm: float = 0.0
    overhead: float = 0.0
    gemm_flops_util: float = 0.0  # sum of GEMM seconds x achieved fraction (drives power)
    fp8_cast_elems: tuple = (0.0, 0.0)  # fp8: GEMM input / output elements cast per forward
    fp8_gemm_calls: int = 0
    imbalance: float = 1.0
    tokens_per_expert: float = 0.0
    dispatch_total: float = 0.0  # before overlap
    # the parts of router / permute / expert that run at the SM clock (GEMMs) and that are
    # memory-bound; the rest of each term (host launch time) does not stretch with the clocks
    router_gemm: float = 0.0
    router_mem: float = 0.0
    permute_mem: float = 0.0
    expert_gemm: float = 0.0
    expert_mem: float = 0.0
    # the host's issue time of the MoE block (router, permutation, dispatch, experts, combine),
    # forward + backward: joins the stage's host issue time (step_time.layer_host_s's, beside the
    # layer's attention part), which the GPU waits for where its own work is shorter
    host: float = 0.0


def moe_tokens(model: ModelSpec, cfg: TrainConfig) -> float:
    """Tokens that enter a MoE layer on one GPU per microbatch: the sequence shard of this rank
    (sequence parallelism splits the tokens over TP before the router, as Megatron requires for
    MoE with TP > 1)."""
    t = cfg.seq / cfg.cp * cfg.mbs
    return t / cfg.tp if cfg.sequence_parallel else t


def tokens_per_expert(model: ModelSpec, cfg: TrainConfig) -> float:
    """Tokens each local expert processes per microbatch with balanced routing: the EP group's
    T·k pairs spread over E experts, gathered over ETP."""
    m = model.moe
    return moe_tokens(model, cfg) * m.top_k * cfg.ep * cfg.etp / m.num_experts


def imbalance(model: ModelSpec, cfg: TrainConfig, c: Constants) -> float:
    """Load of the busiest EP rank over the mean (>= 1); 1 when EP = 1 (one rank holds every
    expert). Statistical spread of multinomial routing plus, for an aux-loss router, the skew of
    a trained router spread over the E / EP experts of a rank."""
    if cfg.ep <= 1:
        return 1.0
    m = model.moe
    return rank_imbalance(m.num_experts, moe_tokens(model, cfg) * m.top_k, cfg.ep,
                      c.moe_router_skew if cfg.moe_router == "aux_loss" else 0.0)


@functools.lru_cache(maxsize=4096)
def rank_imbalance(experts: int, pairs: float, ep: int, skew: float) -> float:
    """Expected busiest of `ep` ranks over the mean, each rank holding experts / ep of `experts`
    experts and receiving `pairs` token-expert pairs on average, for a router whose busiest expert
    carries `skew` over the mean."""
    cv2 = 1.0 / max(1.0, pairs)  # pairs per rank, balanced: multinomial spread
    if skew:
        # the busiest of E experts carries `skew` over the mean: a per-expert cv of skew / z_E
        cv_expert = skew / expected_max_normal(max(experts, 2))
        cv2 += cv_expert ** 2 / (experts / ep)
    return 1.0 + expected_max_normal(ep) * math.sqrt(cv2)


@functools.lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """Expected largest of n independent standard normal draws (0 for n <= 1), by Blom's formula
    Phi^-1((n - 0.375) / (n + 0.25)) (G. Blom, "Statistical Estimates and Transformed Beta-Variables",
    1958; within 0.03 of the exact order statistic: exact 0.564 / 1.029 / 1.424 / 2.508 at
    n = 2 / 4 / 8 / 100, Blom 0.590 / 1.049 / 1.434 / 2.499)."""
    if n <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def router_skew_from_counts(calls: list[list[float]], num_experts: int) -> float:
    """The `moe_router_skew` that recorded tokens per expert show (one list of counts per
    layer-microbatch: all E experts, or the local experts of one EP rank, as runners/moe_probe.py
    records them): the rms over the calls of the counts' coefficient of variation, times z_E (the
    busiest of E experts sits z_E standard deviations above the mean), the parametrisation
    `imbalance` inverts. From each of our runner's EP = 1 aux-loss runs (untrained routers, 4-24
    calls each) rank_imbalance reproduces the busiest group of the same counts at EP 2 / 4 / 8:
    mean error +0.01, mean absolute error 0.05 over 102 cases (tests/test_moe.py)."""
    cvs = [statistics.pstdev(c) / statistics.fmean(c) for c in calls if len(c) > 1 and sum(c) > 0]
    if not cvs:
        return 0.0
    return math.sqrt(statistics.fmean(v * v for v in cvs)) * expected_max_normal(num_experts)


def expert_load(model: ModelSpec, cfg: TrainConfig, c: Constants) -> tuple[float, float]:
    """(work, wait): the busiest EP rank's routed tokens over the mean (what its GEMMs, permutation
    and all-to-all carry), and the busiest rank's work over the mean rank's (what the other ranks
    wait for). Dropless: both the imbalance. With a capacity factor (megatron-core's
    get_capacity: each expert keeps at most ceil(factor x T·k / E) tokens of each source rank, the
    rest are dropped) the busiest load is capped at the factor; padded to capacity
    (--moe-pad-expert-input-to-capacity) every expert computes and exchanges exactly the capacity,
    so every rank carries the factor and none waits."""
    imb = imbalance(model, cfg, c)
    cf = cfg.moe_capacity_factor
    if cf is None:
        return imb, imb
    if cfg.moe_pad_to_capacity:
        return float(cf), 1.0
    capped = min(imb, float(cf))  # below 1 every expert is cut to the capacity
    return capped, max(1.0, capped)


def routed_tokens(model: ModelSpec, cfg: TrainConfig, c: Constants) -> float:
    """Token copies the busiest EP rank's experts take per microbatch: moe_tokens x top_k x its load
    (expert_load's work)."""
    return moe_tokens(model, cfg) * model.moe.top_k * expert_load(model, cfg, c)[0]


def nodes_hit(k: int, nodes: int) -> float:
    """Expected distinct nodes among a token's k experts drawn evenly over `nodes` nodes:
    N (1 - (1 - 1/N)^k). DeepEP sends a token once per node it needs (then forwards it on NVLink)."""
    if nodes <= 1:
        return 1.0
    return nodes * (1.0 - (1.0 - 1.0 / nodes) ** k)


def ep_group_per_node(cluster: ClusterSpec, stride: int, size: int) -> int:
    """Ranks of an EP group (size ranks, `stride` apart: ETP is inner to EP in megatron-core's
    rank order) that share an NVLink domain: an HGX node, or the job's GPUs in one NVL72 rack
    (ClusterSpec.domain_gpus: its 4-GPU trays talk over the rack's NVLink switches, as TP / CP / DP
    groups do in collectives.group_links)."""
    gpn = cluster.domain_gpus
    return max(1, min(size, gpn // stride)) if stride < gpn else 1


def all_to_all_time(nbytes: float, n: int, stride: int, cluster: ClusterSpec, c: Constants) -> float:
    """One NCCL all-to-all over n ranks, each sending nbytes in all (nbytes / n to each peer). In an
    NVLink domain (ep_group_per_node): (n-1)/n of it over NVLink. Across domains each rank's
    off-domain share, (n-g)/n for g ranks of the group per domain, leaves through its own NIC
    (inter_node_bw_gbs per GPU) while the in-domain share rides NVLink at the same time: an
    all-to-all is not a ring, and the k NICs that a ring collective drives together
    (collectives.group_links) do not add up for one rank.
    Latency: one message per peer, issued together (latency x sqrt(n-1), as the other collectives)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    g = ep_group_per_node(cluster, stride, n)
    nvl = cluster.intra_node_bw_gbs * 1e9 * c.nvlink_efficiency
    if n <= g:
        return (n - 1) / n * nbytes / nvl + c.intra_latency_s * (n - 1) ** 0.5
    net = cluster.inter_node_bw_gbs * 1e9 * c.network_efficiency
    return max((n - g) / n * nbytes / net, (g - 1) / n * nbytes / nvl) + c.inter_latency_s * (n - 1) ** 0.5


def deepep_time(tokens: float, k: int, row_bytes: float, n: int, stride: int, cluster: ClusterSpec,
                c: Constants) -> float:
    """One DeepEP dispatch (or combine) of `tokens` tokens of row_bytes each, top-k, over n EP ranks
    (megatron-core's flex dispatcher, DeepEP backend). In a node: the T·k copies over NVLink at
    DeepEP's bottleneck bandwidth (deepep_nvlink_efficiency of the link). Across nodes DeepEP
    sends each token once per node it needs over RDMA and forwards it inside the node on NVLink:
    T x nodes_hit x row_bytes at deepep_rdma_efficiency of the NIC, or the NVLink leg if slower."""
    if n <= 1 or tokens <= 0:
        return 0.0
    g = ep_group_per_node(cluster, stride, n)
    nvl = cluster.intra_node_bw_gbs * 1e9 * c.deepep_nvlink_efficiency
    if n <= g:
        return tokens * k * row_bytes * (n - 1) / n / nvl + c.intra_latency_s
    rdma = cluster.inter_node_bw_gbs * 1e9 * c.deepep_rdma_efficiency
    t_rdma = tokens * nodes_hit(k, n // g) * row_bytes / rdma
    t_nvl = tokens * k * row_bytes * (g - 1) / n / nvl
    return max(t_rdma, t_nvl) + c.inter_latency_s


def expected_max_over_mean(count: int, mean: float) -> float:
    """Expected busiest / mean of `count` multinomial bins of `mean` items each (the forced-routing
    case of `imbalance` at the granularity of single experts)."""
    if count <= 1 or mean <= 0:
        return 1.0
    return 1.0 + expected_max_normal(count) / math.sqrt(mean)


def dispatch_calls(cfg: TrainConfig) -> int:
    """NCCL calls megatron-core 0.19's token dispatcher makes per layer-microbatch, forward +
    backward, where EP > 1 (megatron/core/transformer/moe/token_dispatcher.py). alltoall: the token
    counts all-gathered over the TP x EP group (preprocess; integer, no backward), the tokens and
    their probabilities each all-to-all'd in the dispatch and the outputs in the combine (3), each
    with an all-to-all backward (3): 7. allgather: the hidden states, probabilities and routing map
    all-gathered (3) and the outputs reduce-scattered (1) forward, the hidden states' and
    probabilities' reduce-scatter and the outputs' all-gather backward (3): 7. flex (DeepEP): its
    own kernels, priced by deepep_time: 0."""
    if cfg.ep <= 1 or cfg.moe_dispatcher == "flex":
        return 0
    return 7


def grouped_gemm_fraction(n_tokens: float, c: Constants) -> float:
    """Fraction of the GEMM rate expert GEMMs reach with n tokens per expert (row tiles mostly
    empty for few tokens): n / (n + moe_gemm_half_tokens)."""
    return n_tokens / (n_tokens + c.moe_gemm_half_tokens) if n_tokens > 0 else 0.0


def grouped_expert_host_s(cfg: TrainConfig, c: Constants) -> float:
    """Host seconds per local expert per layer-microbatch (forward + backward) of a grouped-GEMM
    experts phase that issues each expert's GEMMs itself (TE's GroupedLinear on Hopper): the
    BF16 issue cost, plus under a quantized format (FP8 / MXFP8 / NVFP4 through TE) the per-expert
    quantization bookkeeping (moe_fp8_expert_host_s)."""
    fp8 = c.moe_fp8_expert_host_s if cfg.precision != "bf16" else 0.0
    return c.moe_grouped_expert_host_s + fp8


def expert_width_fraction(f: float, c: Constants) -> float:
    """Fraction of the GEMM rate each expert's GEMMs keep at an FFN width of f (per ETP rank):
    f / (f + moe_gemm_half_ffn), 1 where moe_gemm_half_ffn is 0. TE's GroupedLinear runs one cuBLAS
    GEMM per expert (4 streams): fc1's N = 2f, fc2's K = f and their wgrads are short in f, so a
    narrow expert's GEMMs spend more of their time in prologue, epilogue and tail waves than the
    dense model's shape factor (gemm_half_dim, fitted on dense layers' widths of 4K-28K) says. Our
    TE runs' expert forward rates, relative to f = 14336: 0.89 at 7168, 0.83 at 3584, 0.52 at 768
    (h 2048) (data/measurements/h100x4-te.jsonl, moe_probe)."""
    return f / (f + c.moe_gemm_half_ffn) if c.moe_gemm_half_ffn > 0 else 1.0


def moe_layer_time(model: ModelSpec, cfg: TrainConfig, cluster: ClusterSpec, c: Constants,
                   gemm: Callable[..., tuple[float, float]],
                   ep_link, etp_link, collective_time: Callable) -> MoELayerTime:
    """One MoE layer, one microbatch, forward + backward. `gemm(m, k, n, linear=True)` is the
    dense GEMM model of ``step_time`` (seconds, achieved fraction; linear=False: a BF16 GEMM also
    under fp8, as the router is), a function of (cluster, constants, precision) alone; the links
    come from ``step_time.group_link``. Memoised: recommend asks the same MoE layer for the many
    layouts that differ only in PP / DP / VP / recompute (the memo keeps model, cluster and
    constants alive, so their ids are not reused while an entry exists)."""
    key = (id(model), id(cluster), id(c), cfg.tp, cfg.cp, cfg.mbs, cfg.seq, cfg.ep, cfg.etp,
           cfg.sequence_parallel, cfg.precision, cfg.moe_knobs(),
           cfg.num_microbatches, ep_link.bw_gbs, ep_link.latency, etp_link.bw_gbs, etp_link.latency)
    hit = _LAYER_MEMO.get(key)
    if hit is not None and hit[0] is model and hit[1] is cluster and hit[2] is c:
        return dataclasses.replace(hit[3])
    if len(_LAYER_MEMO) > 4096:
        _LAYER_MEMO.clear()
    out = _moe_layer_time(model, cfg, cluster, c, gemm, ep_link, etp_link, collective_time)
    _LAYER_MEMO[key] = (model, cluster, c, out)
    return dataclasses.replace(out)


_LAYER_MEMO: dict[tuple, tuple] = {}


def _moe_layer_time(model: ModelSpec, cfg: TrainConfig, cluster: ClusterSpec, c: Constants,
                    gemm: Callable[..., tuple[float, float]],
                    ep_link, etp_link, collective_time: Callable) -> MoELayerTime:
    m = model.moe
    out = MoELayerTime()
    h = model.hidden_size
    e = c.bytes_activation
    k = m.top_k
    E = m.num_experts
    gated = model.activation == "swiglu"
    hbm = cluster.gpu.hbm_bandwidth_gbs * 1e9 * c.hbm_efficiency
    T = moe_tokens(model, cfg)
    routed = T * k
    E_loc = E / cfg.ep
    f = m.ffn_hidden_size / cfg.etp
    n_e = tokens_per_expert(model, cfg)
    imb, wait = expert_load(model, cfg, c)  # busiest rank's load (capped / padded), and its wait
    # tokens per expert the grouped GEMM sees: padded to capacity, every expert's is the capacity
    n_g = n_e * imb if cfg.moe_capacity_factor is not None and cfg.moe_pad_to_capacity else n_e
    out.imbalance, out.tokens_per_expert = wait, n_g

    # router: GEMM (fwd + 2 bwd), fp32 scores / top-k / aux loss over T x E, launch cost
    tg, u = gemm(T, h, E, linear=False)
    r_gemm = 3 * tg
    # (--moe-router-fusion: TE's fused top-k / softmax / aux-loss kernels pass over them fewer times)
    r_mem = (c.moe_router_fused_passes if cfg.moe_router_fusion else c.moe_router_passes) * T * E * 4 / hbm
    # launch cost: ~30 small kernels unfused; TE's fused router kernels (or the recipes' CUDA-graphed
    # router) launch a few, whatever E
    r_over = (c.moe_router_fused_overhead_s if cfg.moe_router_fusion
              else c.moe_router_overhead_s + E * c.moe_router_per_expert_s)
    out.router = r_gemm + r_mem + r_over
    out.router_gemm, out.router_mem = r_gemm, r_mem
    out.gemm += r_gemm
    out.gemm_flops_util += r_gemm * u
    out.memory_bound += r_mem
    out.overhead += r_over

    # permute / unpermute (alltoall: before / after the all-to-all and the local chunk re-sort;
    # allgather: the local permutation of the gathered tokens), forward and backward, busiest rank
    # (--moe-permute-fusion: TE's moe_permute / moe_unpermute / sort_chunks_by_index kernels, one
    # launch each and no host-side chunk loop; unfused: megatron-core's index_select / scatter_add)
    fused = cfg.moe_permute_fusion
    passes = c.moe_permute_fused_passes if fused else c.moe_permute_passes
    if fused and cfg.moe_dispatcher == "alltoall" and cfg.ep > 1 and E_loc > 1:
        # TE's sort_chunks_by_index re-sorts the received tokens by local expert and back (dispatch
        # and combine side), a read and a write of the routed tokens each, forward and backward
        passes += SORT_CHUNKS_PASSES
    p_mem = passes * routed * imb * h * e / hbm
    p_over = c.moe_permute_fused_overhead_s if fused else c.moe_permute_overhead_s
    if cfg.moe_dispatcher == "alltoall" and E_loc > 1 and not fused:
        p_over += E_loc * c.moe_permute_per_expert_s
    out.permute = p_mem + p_over
    out.permute_mem = p_mem
    out.memory_bound += p_mem
    out.overhead += p_over

    # dispatch + combine, forward and backward: 4 collectives of the routed tokens
    if cfg.ep > 1:
        if cfg.moe_dispatcher == "allgather":
            # all-gather the T x h tokens of every EP x ETP rank, reduce-scatter the outputs back
            # (megatron's MoEAllGatherTokenDispatcher; the reduce-scatter runs in fp32 probs dtype)
            n = cfg.ep * cfg.etp
            one = collective_time("all_gather", T * h * e * n, n, ep_link.bw_gbs, ep_link.latency)
            d = 2 * (one + collective_time("reduce_scatter", T * h * 4 * n, n, ep_link.bw_gbs, ep_link.latency))
        elif cfg.moe_dispatcher == "flex":  # DeepEP: dispatch + combine, forward and backward
            d = 4 * deepep_time(T * imb, k, h * e, cfg.ep, cfg.etp, cluster, c)
        else:  # NCCL all-to-all: NVLink in a node, each rank's NIC across nodes (not a ring)
            d = 4 * all_to_all_time(routed * imb * h * e, cfg.ep, cfg.etp, cluster, c)
    else:
        d = 0.0
    if cfg.etp > 1:  # expert TP: all-gather the routed tokens in, reduce-scatter the outputs
        d += 2 * 2 * collective_time("all_gather", routed * imb * h * e * cfg.etp, cfg.etp,
                                     etp_link.bw_gbs, etp_link.latency)
    out.dispatch_total = d
    exposed = d * c.moe_a2a_exposed
    # ... and each of the dispatcher's calls, a small NCCL call's host issue and launch after the
    # token-count sync emptied the queue (moe_dispatch_call_s: our VM's; 0 on the published hosts)
    calls = dispatch_calls(cfg) * c.moe_dispatch_call_s
    out.dispatch_total += calls

    # experts: fc1 (h -> 2f gated), activation x probs, fc2 (f -> h); fwd + 2x bwd; the busiest
    # rank has imb x the mean tokens
    frac = grouped_gemm_fraction(n_g, c) * expert_width_fraction(f, c)
    mats = 2 if gated else 1
    x_gemm = x_stream = 0.0
    if n_e > 0 and frac > 0:
        # full-size GEMM efficiency in the h and f dimensions, the token dimension by frac
        t1, u1 = gemm(c.moe_gemm_reference_tokens, h, mats * f)
        t2, u2 = gemm(c.moe_gemm_reference_tokens, f, h)
        per_token = (t1 + t2) / c.moe_gemm_reference_tokens
        x_gemm = 3 * per_token * n_e * E_loc * imb / (frac * c.moe_gemm_efficiency)
        util = (u1 * t1 + u2 * t2) / (t1 + t2) * c.moe_gemm_efficiency
        if cfg.moe_grouped_gemm:
            # one grouped GEMM keeps every SM busy: the rate it loses to few tokens per expert is
            # time spent streaming each expert's weights and partial token tiles (memory-bound)
            x_stream = x_gemm * (1.0 - frac)
        else:
            # SequentialMLP: one small GEMM per expert leaves most SMs idle (low power per time)
            util *= frac
        out.gemm_flops_util += (x_gemm - x_stream) * util
        rows = routed * imb
        out.fp8_cast_elems = (rows * (h + f), rows * (mats * f + h))
        out.fp8_gemm_calls = 2 * (1 if cfg.moe_grouped_gemm else int(E_loc))
    x_mem = c.moe_expert_elementwise_passes * routed * imb * f * e / hbm
    # ... and each local expert weight's gradient added into its fp32 main grad in the experts'
    # backward (grad_accum_bytes_per_param; inside the phase the runner times, and behind
    # SequentialMLP's host loop when that is slower)
    # (none with gradient_accumulation_fusion: the grouped wgrad GEMM accumulates into it)
    if not cfg.gradient_accumulation_fusion:
        x_mem += E_loc * (h * mats * f + f * h) * c.grad_accum_bytes_per_param / hbm
    gpu = x_gemm + x_mem + c.moe_expert_overhead_s
    # the host launches expert after expert: SequentialMLP each expert's MLP (the GPU waits when
    # that is slower); TE's GroupedLinear one cuBLAS GEMM per local expert in each of its six GEMM
    # groups (moe_grouped_expert_host_s; 0 where one grouped kernel runs all experts)
    if cfg.moe_grouped_gemm:
        # grouped: the host issues the per-expert work once the token counts reached it (a
        # device-to-host sync, moe_expert_overhead_s); each expert's GEMMs run as soon as they are
        # issued, so the phase takes the longer of the GPU's work and the host's issue time (the
        # Qwen3 proxy's experts phase: flat from 4K to 8K tokens per GPU, then growing with them)
        out.expert = max(x_gemm + x_mem, E_loc * grouped_expert_host_s(cfg, c)) + c.moe_expert_overhead_s
    else:
        out.expert = max(gpu, E_loc * c.moe_sequential_expert_s)
    out.gemm += x_gemm - x_stream
    out.memory_bound += x_mem + x_stream
    out.expert_gemm, out.expert_mem = x_gemm - x_stream, x_mem + x_stream
    # the block's host issue time: its fixed launches (moe_layer_host_s) and, for a GroupedLinear
    # that issues expert by expert, each local expert's (0 for one grouped kernel; SequentialMLP's
    # host loop is priced in the phase itself)
    out.host = c.moe_layer_host_s + (E_loc * grouped_expert_host_s(cfg, c) if cfg.moe_grouped_gemm else 0.0)
    out.overhead += out.expert - x_gemm - x_mem  # launch-bound time beyond the GPU work
    if not cfg.moe_grouped_gemm:  # ... and its 2 weight tensors per expert in the optimizer's and
        # gradient handling's per-tensor loops, once per step (spread over the microbatches)
        out.overhead += E_loc * 2 * c.moe_sequential_tensor_step_s / cfg.num_microbatches

    # shared experts: a dense MLP on every token of the microbatch (TP-sharded, as Megatron does)
    if m.shared_ffn_hidden_size:
        Ts = cfg.seq / cfg.cp * cfg.mbs
        fs = m.shared_ffn_hidden_size / cfg.tp
        t1, u1 = gemm(Ts, h, mats * fs)
        t2, u2 = gemm(Ts, fs, h)
        s_gemm = 3 * (t1 + t2)
        s_mem = c.moe_expert_elementwise_passes * Ts * fs * e / hbm
        out.shared = s_gemm + s_mem
        out.gemm += s_gemm
        out.gemm_flops_util += 3 * (t1 * u1 + t2 * u2)
        out.memory_bound += s_mem
    exposed = _exposed_dispatch(exposed, cfg, out, x_gemm, x_mem) + calls
    out.dispatch = exposed
    out.comm += exposed
    return out


def _exposed_dispatch(exposed: float, cfg: TrainConfig, out: MoELayerTime, x_gemm: float, x_mem: float) -> float:
    """The dispatch / combine time left on the critical path. Shared-expert overlap
    (--moe-shared-expert-overlap) runs the shared experts on a side stream while the tokens are
    in flight. The 1F1B all-to-all overlap (--overlap-moe-expert-parallel-comm) pairs the forward
    of one microbatch with the backward of another layer by layer, so each one's all-to-alls run
    behind the other's expert and shared-expert work (the GEMMs, fwd + bwd, of the layer); the
    first forward and the last backward of a step have no partner, 1/m of it stays exposed."""
    if cfg.moe_shared_expert_overlap and out.shared > 0:
        exposed = max(0.0, exposed - out.shared)
    if cfg.moe_a2a_overlap and cfg.ep > 1:
        m = max(1, cfg.num_microbatches)
        hide = x_gemm + x_mem + out.shared
        exposed = exposed / m + (m - 1) / m * max(0.0, exposed - hide)
    return exposed


def moe_activation_elements(model: ModelSpec, cfg: TrainConfig, c: Constants) -> tuple[float, float]:
    """(elements kept in BF16, elements that are inputs of the experts' GEMMs: FP8 copies under
    fp8) one MoE layer's MLP block keeps for the backward, per microbatch, on the busiest GPU. Per
    routed token: the permuted input (GEMM input) and the expert output (h each), the fc1 output
    (2f gated), the activation and its probability-weighted copy (f each, the latter the fc2
    input); the router's fp32 logits / probabilities (T x E); shared experts like a dense MLP.
    Memoised like moe_layer_time."""
    key = (id(model), id(c), cfg.tp, cfg.cp, cfg.mbs, cfg.seq, cfg.ep, cfg.etp, cfg.sequence_parallel,
           cfg.moe_router, cfg.moe_capacity_factor, cfg.moe_pad_to_capacity)
    hit = _ACT_MEMO.get(key)
    if hit is not None and hit[0] is model and hit[1] is c:
        return hit[2]
    if len(_ACT_MEMO) > 4096:
        _ACT_MEMO.clear()
    out = _moe_activation_elements(model, cfg, c)
    _ACT_MEMO[key] = (model, c, out)
    return out


_ACT_MEMO: dict[tuple, tuple] = {}


def _moe_activation_elements(model: ModelSpec, cfg: TrainConfig, c: Constants) -> tuple[float, float]:
    m = model.moe
    T = moe_tokens(model, cfg)
    routed = routed_tokens(model, cfg, c)
    gated = model.activation == "swiglu"
    # expert TP gathers the routed tokens of its ETP ranks and splits f: per GPU etp x the tokens
    # at f / etp (the same FFN elements), etp x the hidden ones
    hid = c.moe_act_hidden_per_token * model.hidden_size * cfg.etp
    ffn = (c.moe_act_ffn_per_token + (1 if gated else 0)) * m.ffn_hidden_size
    gemm_in = routed * (model.hidden_size * cfg.etp + m.ffn_hidden_size)  # fc1 and fc2 inputs
    elems = routed * (hid + ffn) - gemm_in
    elems += T * m.num_experts * c.moe_act_router_fp32 * 4 / c.bytes_activation
    if m.shared_ffn_hidden_size:
        s = cfg.seq / cfg.cp * cfg.mbs
        fs = m.shared_ffn_hidden_size / cfg.tp
        elems += (2 if gated else 1) * s * fs
        gemm_in += s * fs
    return elems, gemm_in


def ep_reason(model: ModelSpec, cfg: TrainConfig, cluster: ClusterSpec, breakdown: dict, step_s: float,
              c: Constants) -> str:
    """One clause for `recommend`: why this EP — experts per GPU, where the all-to-all runs, its
    share of the step, the busiest rank's load and the tokens per expert."""
    m = model.moe
    local = m.num_experts // max(cfg.ep, 1)
    span = cfg.ep * cfg.etp
    dom = cluster.domain_gpus
    where = "NVLink" if span <= dom else f"the network ({span // dom} NVLink domains)"
    a2a = breakdown.get("moe_dispatch_s", 0.0)
    share = a2a / step_s if step_s > 0 else 0.0
    if cfg.ep <= 1:
        return (f"EP=1: all {m.num_experts} experts on every GPU (no all-to-all), "
                f"{tokens_per_expert(model, cfg):.0f} tokens/expert")
    disp = "DeepEP (flex)" if cfg.moe_dispatcher == "flex" else cfg.moe_dispatcher
    etp = f", ETP={cfg.etp} (each expert's GEMMs split {cfg.etp} ways)" if cfg.etp > 1 else ""
    return (f"EP={cfg.ep}{etp}: {local} expert{'s' if local != 1 else ''}/GPU, {disp} over {where} "
            f"= {share:.0%} of the step (exposed), busiest rank {imbalance(model, cfg, c):.2f}x the mean load, "
            f"{tokens_per_expert(model, cfg):.0f} tokens/expert")


# ------------------------------------------------------------------------------------------------
# fitting: which MoE constants each stack profile fits, within which physical ranges
# ------------------------------------------------------------------------------------------------

# Fitted on this project's runner (`local` stack, data/measurements/h100x1-moe*.jsonl) by
# bench/moe_check.py, on whole-step time, the timed sub-steps and peak memory.
MOE_LOCAL_FIT: dict[str, tuple[float, float]] = {
    "moe_router_passes": (2.0, 40.0),
    "moe_router_overhead_s": (1e-5, 5e-3),
    "moe_router_per_expert_s": (1e-8, 5e-5),
    "moe_permute_passes": (2.0, 80.0),
    "moe_permute_overhead_s": (1e-5, 1e-2),
    "moe_permute_per_expert_s": (1e-8, 1e-4),
    "moe_gemm_half_tokens": (16.0, 4096.0),
    "moe_gemm_efficiency": (0.3, 1.0),
    "moe_expert_elementwise_passes": (2.0, 40.0),
    "moe_expert_overhead_s": (1e-6, 5e-3),
    "moe_sequential_expert_s": (5e-5, 5e-3),
    "moe_sequential_tensor_step_s": (1e-6, 2e-3),
    "moe_act_hidden_per_token": (1.0, 4.0),
    "moe_act_ffn_per_token": (2.0, 6.0),
    "moe_act_router_fp32": (1.0, 6.0),
}

# The Transformer Engine stack (NeMo / Megatron-Bridge MoE recipes) before fitting: settings of the
# stack, each with its source. The recipes' fused permutation and fused / CUDA-graphed router are
# layout knobs (moe_permute_fusion, moe_router_fusion: the te profile's layout defaults,
# models/profiles.py), priced by their own constants; a TE run without them (this runner's) pays
# megatron-core's unfused costs, which are the same code as the local stack's (measured there).
# Grouped GEMM is TE's GroupedLinear: in BF16 and FP8 on Hopper one cuBLASLt GEMM per expert.
MOE_TE_SETTINGS: dict[str, float] = {
    # activations as megatron-core 0.19 keeps them with TEGroupedMLP, per routed token: the fc1
    # input (h: GroupedLinear saves its input, the all-to-all output sorted by local expert; an FP8
    # copy under fp8), the fused weighted SwiGLU's input (2f: weighted_bias_swiglu saves it with
    # the probabilities) and the fc2 input (f); nothing hidden-sized besides: the permutation's
    # index_select, the all-to-all, sort_chunks_by_idxs' cat and unpermute's scatter_add (probs
    # applied in the activation, not in unpermute) save indices only, so the expert output and
    # the a2a buffers are transient. Was 2 h (the expert output counted as kept): peak allocated
    # of the te MoE runs over-predicted by up to 4.7 GiB (te-eqw3-ep-02, Qwen3 proxy: h large
    # next to f); with 1 h within -2.0..+0.8 GiB (python bench/memory_terms.py
    # data/measurements/*.jsonl --stack te --moe). fp32 router logits and probabilities (2 copies over E)
    "moe_act_hidden_per_token": 1.0,
    "moe_act_ffn_per_token": 2.0,
    "moe_act_router_fp32": 2.0,
    # the hidden-sized token buffers a TEGroupedMLP layer with the all-to-all dispatcher holds beside
    # what it saves while it runs: measured at the recompute peak of the Qwen3 proxy 12L EP4 mbs8 full
    # recompute (x4-te-s30d, te-qw3-snap-32, `python bench/memory_snapshot.py`): the permutation's
    # output (1.00 GiB), the all-to-all's (1.12 in 2 blocks), the experts' fc2 output (1.12) and a
    # second sort_chunks_by_idxs output (1.12) live beside the saved fc1 input, fc1 output and
    # SwiGLU output: 4.36 GiB = 4.1 routed tokens x h x 2 B (1.07 GB each at the busiest rank's
    # load); the twin runs without the snapshot peaked at 41.5 / 41.7 GiB, predicted 37.1 without them
    # and 38.4 with them; with forced load balancing 39.6 against 38.2 (x4-te-s30e: the rest of the
    # aux-loss runs' excess is their untrained router's first steps)
    "moe_transient_hidden_per_token": 4.0,
    # the caching allocator's stranded MoE token buffers (allocator_memory.reserved_free_gib), fitted on
    # the te MoE stages: 1.641 by least squares (29 stages, 2 architectures; `python
    # bench/moe_allocator.py --pipeline`, p 0.5), where the local stack's is 0.971 (Constants)
    "alloc_reserved_moe": 1.64,
    # fitted within MOE_TE_FIT's ranges on the 19 published H100 MoE rows (no MoE host cost: their
    # hosts) and our TE MoE runs (our VM's, MOE_TE_VM_HOST) (`python bench/moe_check.py --quick`,
    # section 3's proposed values, rounded; in sample 13.4%; refitted in session 28 on the dense
    # constants of the cross-entropy refit, with the DeepSeek-V2-Lite proxy's runs: in sample 14.3%,
    # 16.8% with the earlier values). The permutation's passes and the
    # experts' fixed time sit at the top of their physical ranges: the published rows want more
    # per-layer time than those kernels explain
    "moe_a2a_exposed": 1.0,
    "moe_gemm_half_tokens": 879.0,
    "moe_permute_fused_passes": 8.0,
    "moe_expert_overhead_s": 1e-4,
    "moe_gemm_half_ffn": 1369.0,
    # GroupedLinear in BF16 on Hopper runs each expert's GEMMs as ordinary cuBLAS GEMMs (4 streams):
    # the dense GEMM model's rate, not a grouped kernel's (our TE runs' Mixtral proxy experts, 9-66K
    # tokens per GPU: 683 / 671 / 589 TFLOP/s per rank-0 probe, the dense model 740); what narrow
    # experts lose is priced by their width (moe_gemm_half_ffn)
    "moe_gemm_efficiency": 1.0,
    # megatron-core's TEGroupedMLP with bias_activation_fusion (the TE stack's default, and the
    # runner's): weighted_bias_swiglu_impl, one fused kernel reading 2f and writing f forward (the
    # router probabilities applied in it), reading the f gradient and the 2f input and writing the
    # 2f gradient backward: 8 passes of f per routed token (the local stack's unfused SwiGLU, probs
    # product and casts: 21.2, fitted)
    "moe_expert_elementwise_passes": 8.0,
}
# Proposed for the te profile's fit on the published H100 MoE rows (bench/moe_check.py prints the
# fit and its leave-one-model-out error): the exposed all-to-all fraction (1F1B / shared-expert
# overlap, DeepEP), the grouped GEMM's efficiency and saturation, the fused permutation's passes.
# The unfused router and permutation constants: megatron-core's own code, the same under TE (a TE
# run without --moe-router-fusion / --moe-permute-fusion pays them), so every profile keeps the
# values measured on the local stack (models/constants.py) for them.
MOE_UNFUSED: tuple[str, ...] = ("moe_router_passes", "moe_router_overhead_s", "moe_router_per_expert_s",
                                "moe_permute_passes", "moe_permute_overhead_s", "moe_permute_per_expert_s")


# The MoE host issue costs: a property of the machine the GPUs sit in (as the dense host_* of
# models/profile_fit.HOST), not of the stack. Our VM issues a small op in ~40-90 us of host time (a
# bare small NCCL call from an idle GPU: 72-90 us, data/microbench/h100x4-nccl-bw.jsonl; 91 us per
# launch on the unblocked llama3-8b TE runs, bench/host_issue.py), where a bare-metal host's eager
# PyTorch op costs ~5-15 us: no published dense row is host-bound at any cost our runs allow
# (docs/calibration.md). The te profile ships them at 0 (the published runs' hosts) and keeps our
# VM's values apart (MOE_TE_VM_HOST, in the profile's fit_info["moe_vm_host"]), which
# profile_fit.on_vm applies to our own runs.
MOE_HOST: tuple[str, ...] = ("moe_layer_host_s", "moe_grouped_expert_host_s", "moe_fp8_expert_host_s",
                             "moe_dispatch_call_s")
# our VM's: the MoE layer's fixed and the grouped / FP8 per-expert host costs fitted within
# MOE_VM_HOST_FIT's ranges on our 70 TE MoE runs of four shapes (`python bench/moe_check.py --host`,
# session 29: MAPE 14.4% in sample, 15.5% with the first fit of session 29 on three shapes (18.5 /
# 0.241 / 0.136 ms), 16.3% with session 28's per-expert costs priced in the experts phase alone; each
# shape left out of the fit: DeepSeek-V2-Lite 14.8%, Mixtral 12.6%, OLMoE 27.2%, Qwen3 19.3%). The
# same layouts on two machines differ by up to 28% where the host binds (x4-te-s29 / -s29b: OLMoE EP1
# mbs2 16,060 / 20,537 tok/s/GPU): what one set of VM costs cannot follow (records now carry their
# host's issue time, env.host_op_us). The dispatcher's per-call cost is measured (models/constants.py
# moe_dispatch_call_s)
MOE_TE_VM_HOST: dict[str, float] = {
    "moe_layer_host_s": 19.8e-3,
    "moe_grouped_expert_host_s": 0.278e-3,
    "moe_fp8_expert_host_s": 0.171e-3,
    "moe_dispatch_call_s": DEFAULT.moe_dispatch_call_s,
}


def without_moe_host(c: Constants) -> Constants:
    """`c` with no MoE host issue cost (MOE_HOST at 0): how the published runs' hosts are priced."""
    return c.replace(**{n: 0.0 for n in MOE_HOST})


def te_moe_constants(c: Constants) -> Constants:
    """`c` (a te profile's constants) with the MoE settings of the TE stack: MOE_TE_SETTINGS, the
    unfused router / permutation constants as measured (MOE_UNFUSED), and no MoE host issue cost
    (MOE_HOST: the published runs' hosts; our VM's are MOE_TE_VM_HOST)."""
    return without_moe_host(c.replace(**{n: getattr(DEFAULT, n) for n in MOE_UNFUSED}, **MOE_TE_SETTINGS))


MOE_TE_FIT: dict[str, tuple[float, float]] = {
    "moe_a2a_exposed": (0.05, 1.0),
    "moe_gemm_half_tokens": (16.0, 4096.0),
    # TE's moe_permute / moe_unpermute, forward + backward, over the routed tokens T·k·h: the
    # permute reads T·h and writes T·k·h (1 + 1/k passes), the unpermute reads T·k·h and writes T·h
    # (1 + 1/k), their backward the same again, and the unpermute's backward re-reads its forward
    # input for the probabilities' gradient (1): 4 (1 + 1/k) + 1 = 5.5 (k = 8) to 7 (k = 2); the
    # range 4-8 (sort_chunks_by_index apart: SORT_CHUNKS_PASSES)
    "moe_permute_fused_passes": (4.0, 8.0),
    # per layer-microbatch fixed GPU time of the experts phase beside its GEMMs: a few kernel
    # launches' worth (the split offsets, workspace setup and the GEMM groups' first launches, forward
    # and backward: 2-20 launches at ~5 us); the host's issue time is moe_grouped_expert_host_s
    "moe_expert_overhead_s": (5e-6, 1e-4),
    # the FFN width at which an expert's cuBLAS GEMMs reach half their rate (expert_width_fraction):
    # between the dense model's gemm_half_dim (96) and a few thousand
    "moe_gemm_half_ffn": (50.0, 3000.0),
}
# Our VM's MoE host issue costs (MOE_HOST but the dispatcher's per-call cost, measured), fitted on our
# TE MoE runs alone (`python bench/moe_check.py --host`: the published rows carry no host cost)
# within these ranges: MOE_TE_VM_HOST
MOE_VM_HOST_FIT: dict[str, tuple[float, float]] = {
    # the MoE layer's fixed host issue time beyond a dense layer's, per layer-microbatch (forward +
    # backward). Counted on our TE MoE runs' kernel profiles (`python bench/host_issue.py`, last
    # section): a MoE layer issues ~101 more kernel launches than a dense one (176 against a median
    # 74) and ~710 more CPU-side profiler events (1,278 against 569); at our VM's ~78 us per launch
    # (host_layer_s / a dense layer's launches) or 11.6 us per event: ~8 ms of issue. Each MoE layer's
    # forward also synchronises (the token counts copied to the host before the dispatch) and its
    # all-to-alls wait for the EP group's slowest host, so the layer's issue cannot run ahead of the
    # GPU nor of the other ranks: up to as much again. 2-20 ms
    "moe_layer_host_s": (2e-3, 20e-3),
    # TE GroupedLinear's host issue time per local expert per layer-microbatch: 6 cuBLASLt calls at
    # 5-60 us each, 2 weight-gradient allocations, 2 AccumulateGrad nodes and megatron DDP hooks
    # (each a Python call; with the main-grad add kernel where gradient_accumulation_fusion is off);
    # counted: 9.3 launches and ~99 CPU events per local expert (bench/host_issue.py)
    "moe_grouped_expert_host_s": (5e-5, 8e-4),
    # ... and FP8's share: ~10 quantized-tensor objects and weight-workspace calls per expert at
    # 2-40 us each (moe_fp8_expert_host_s, models/constants.py); counted: 3.5 more launches per
    # local expert under FP8
    "moe_fp8_expert_host_s": (1e-5, 4e-4),
}
