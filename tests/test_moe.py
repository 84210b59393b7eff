"""The mixture-of-experts layer (model/moe.py: MoE, route, LocalDispatch, Experts) and expert parallelism's dispatch
(parallel/expert_parallel/dispatch.py), against references that share none of their code.

- The layer against a per-token loop in float64 (each token: its top k by score + bias, stably; gates renormalised;
  the sum over its experts of gate * GPT-2 MLP): output and every gradient within float64 rounding of it.
- Ties route to the lower expert index; a router that sends every token to one expert drops none.
- The grouped GEMM (torch._grouped_mm) and the per-expert loop give the same bits; the loop's backward makes each
  stacked weight's gradient once; the grouped kernel runs only where it is a kernel of its own (CPU fp32, bf16 on
  sm90/sm100), under autocast too (operands cast, autocast off: then no host read of the group sizes).
- The rows cast to the compute dtype before dispatch (moe.expert_rows) change no bit of the layer.
- The balancing loss equals its formula; the bias takes sign(mean - load) steps.
- Init: an expert-parallel rank's slice of each stacked weight is the one process's.
- On 2 spawned gloo ranks, the all_to_all dispatch (each rank's tokens to the rank holding their expert and back)
  gives each rank what the local dispatch gives on one process for the same tokens and experts: output and
  gradients, bit for bit (every expert's rows are the same rows in the same order as one process's: rank 0's
  tokens first, then rank 1's), and it sends the bytes the formula says; under bf16 autocast too, its rows in
  bf16 (half the bytes of ln_2's fp32 output).
"""

from __future__ import annotations

import contextlib
import unittest
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model import moe as moe_module
from model.gpt import GPT, init_parameter, make_config
from model.moe import MoE, balance_experts, grouped_linear, grouped_mm_runs, route
from tests.harness import run_distributed

SEED = 0


def config(E: int = 4, k: int = 2, **kw):
    return make_config("tiny", n_layer=2, vocab_size=256, block_size=32, moe_num_experts=E, moe_top_k=k, **kw)


def moe(E: int = 4, k: int = 2, dtype=torch.float32, **kw) -> MoE:
    """Block 0's MoE of a tiny GPT, initialised by name."""
    model = GPT(config(E, k, **kw))
    model.init_weights(SEED)
    return model.transformer.h[0].mlp.to(dtype)


class NewTensors(TorchDispatchMode):
    """Records each op whose output is a new tensor (not a view of an input) of one of `shapes`."""

    def __init__(self, shapes: set[tuple[int, ...]]):
        super().__init__()
        self.shapes, self.seen = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.seen += [
            str(func)
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor)
            and tuple(t.shape) in self.shapes
            and t.untyped_storage().data_ptr() not in inputs
        ]
        return out


def fast_path_here(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """moe.grouped_mm_runs as on an sm90 GPU, with this CPU standing in: bf16 takes torch._grouped_mm."""
    return device.type == "cpu" and dtype == torch.bfloat16 and (k * 2) % 16 == 0 and (n * 2) % 16 == 0


def naive(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE's output token by token, by its definition (no sorting, no grouping)."""
    W, E = layer.router.weight, layer.router.weight.shape[0]
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        scores = torch.softmax(token @ W.t(), -1)
        biased = (scores + layer.expert_bias).tolist()
        chosen = sorted(range(E), key=lambda e: (-biased[e], e))[: layer.k]  # ties: the lower index
        gates = scores[chosen] / scores[chosen].sum()
        y = 0
        for g, e in zip(gates, chosen):
            fc, proj = layer.experts.c_fc, layer.experts.c_proj
            h = F.gelu(token @ fc.weight[e] + fc.bias[e], approximate="tanh")
            y = y + g * (h @ proj.weight[e] + proj.bias[e])
        out.append(y)
    return torch.stack(out).view_as(x)


class TheLayer(unittest.TestCase):
    def test_equals_the_per_token_definition_in_float64(self):
        """float64: every value within a few ulps of the loop's (the sums are ordered differently)."""
        layer = moe(dtype=torch.float64)
        x = torch.randn(2, 8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        got = layer(x)
        ref = naive(layer, x)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
        g = torch.randn_like(got)
        grads = torch.autograd.grad(got, [x, *layer.parameters()], g)
        want = torch.autograd.grad(ref, [x, *layer.parameters()], g)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)

    def test_ties_go_to_the_lower_index(self):
        scores = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.1, 0.4], [0.3, 0.2, 0.3, 0.2]])
        chosen, margin = route(scores, torch.zeros(4), 2)
        self.assertEqual(chosen.tolist(), [[0, 1], [1, 3], [0, 2]])
        torch.testing.assert_close(margin, torch.tensor([0.0, 0.3, 0.1]))  # k-th minus (k+1)-th

    def test_a_router_sending_every_token_to_one_expert_drops_none(self):
        """k = 1, the router's weight zero and the bias favouring expert 2: all N tokens go to expert 2 and each
        comes out as expert 2's MLP of itself (gate 1)."""
        layer = moe(k=1)
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.expert_bias[2] = 1.0
        x = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(2))
        with torch.enable_grad():
            y = layer(x)
        self.assertEqual(layer.load.tolist(), [0, 0, 24, 0])
        fc, proj = layer.experts.c_fc, layer.experts.c_proj
        want = F.gelu(x @ fc.weight[2] + fc.bias[2], approximate="tanh") @ proj.weight[2] + proj.bias[2]
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)

    def test_grouped_gemm_and_loop_give_the_same_bits(self):
        """torch._grouped_mm (CPU, fp32, 16-byte aligned) against the loop of per-expert matmuls it replaces, with
        an empty group among them; forward and both gradients."""
        g = torch.Generator().manual_seed(3)
        x = torch.randn(20, 64, generator=g, requires_grad=True)
        w = torch.randn(4, 64, 32, generator=g, requires_grad=True)
        sizes = [7, 0, 9, 4]
        ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
        grouped = grouped_linear(x, w, ends)
        loop = torch.cat([xe @ w[e] for e, xe in enumerate(x.split(sizes))])
        self.assertTrue(torch.equal(grouped, loop))
        dy = torch.randn_like(loop)
        self.assertTrue(
            all(
                torch.equal(a, b)
                for a, b in zip(torch.autograd.grad(grouped, [x, w], dy), torch.autograd.grad(loop, [x, w], dy))
            )
        )

    def test_loop_backward_makes_each_weight_gradient_once(self):
        """Under bf16 autocast on CPU the experts run the per-expert loop. Its backward makes each stacked weight's
        (E, K, N) gradient once (w.unbind's stack), where w[e] made one zero (E, K, N) tensor per expert (select's
        backward) and summed them (E - 1 adds): 2E - 1 = 15 full-size tensors per weight at E = 8 (at GPT-2's
        sizes 15 x 75.5 MB = 1.1 GB per weight per micro-batch, against 75.5 MB)."""
        E = 8
        layer = moe(E=E)
        x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(x)
        shapes = {tuple(p.shape) for p in layer.experts.parameters() if p.dim() == 3}  # (E, C, H), (E, H, C)
        with NewTensors(shapes) as new:
            y.float().sum().backward()
        self.assertEqual(sorted(new.seen), ["aten.stack.default"] * 2)

    def test_the_loop_over_unbind_gives_the_bits_of_the_loop_over_select(self):
        """w.unbind(0)[e] is w[e] (the same view): the same products forward, the same gradients (each element of
        a select's zero tensor plus one expert's value is that value), fp32 and under bf16 autocast."""
        g = torch.Generator().manual_seed(5)
        x = torch.randn(20, 64, generator=g, requires_grad=True)
        w = torch.randn(4, 64, 32, generator=g, requires_grad=True)
        sizes = [7, 0, 9, 4]
        ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
        for autocast in (False, True):
            with (
                torch.autocast("cpu", torch.bfloat16, enabled=autocast),
                mock.patch.object(moe_module, "grouped_mm_runs", lambda *a: False),
            ):
                got = grouped_linear(x, w, ends, sizes)
                want = torch.cat([xe @ w[e] for e, xe in enumerate(x.split(sizes))])
            self.assertTrue(torch.equal(got, want), autocast)
            dy = torch.randn_like(want)
            for a, b in zip(torch.autograd.grad(got, [x, w], dy), torch.autograd.grad(want, [x, w], dy)):
                self.assertTrue(torch.equal(a, b), autocast)

    def test_the_grouped_kernel_runs_only_where_it_is_one(self):
        """moe.grouped_mm_runs from (device, dtype, K, N) alone: CPU fp32 (aligned); not CPU bf16 (autocast's loop,
        as ever); on CUDA bf16 at compute capability 9.x and 10.x only (elsewhere torch's _grouped_mm reads the
        group ends back and loops), never fp32 there; never unaligned widths (16 bytes)."""
        cpu = torch.device("cpu")
        self.assertTrue(grouped_mm_runs(cpu, torch.float32, 64, 256))
        self.assertFalse(grouped_mm_runs(cpu, torch.bfloat16, 64, 256))
        self.assertFalse(grouped_mm_runs(cpu, torch.float32, 66, 256))
        gpu = torch.device("cuda", 0)
        for capability, dtype, k, want in (
            ((9, 0), torch.bfloat16, 64, True),
            ((10, 0), torch.bfloat16, 64, True),
            ((8, 0), torch.bfloat16, 64, False),
            ((12, 0), torch.bfloat16, 64, False),
            ((9, 0), torch.float32, 64, False),
            ((9, 0), torch.float16, 64, False),
            ((9, 0), torch.bfloat16, 60, False),
        ):
            module = mock.Mock(get_device_capability=mock.Mock(return_value=capability))
            with (
                mock.patch.object(torch, "get_device_module", return_value=module),
                mock.patch.object(torch.version, "hip", None),
            ):
                self.assertEqual(grouped_mm_runs(gpu, dtype, k, 256), want, (capability, dtype, k))
            if want:
                module.get_device_capability.assert_called_with(gpu)
        with mock.patch.object(torch.compiler, "is_compiling", return_value=True):  # inside torch.compile: bf16 only
            self.assertTrue(grouped_mm_runs(cpu, torch.bfloat16, 64, 256))
            self.assertFalse(grouped_mm_runs(cpu, torch.float32, 64, 256))
            for capability, want in (((9, 0), True), ((8, 0), False)):
                module = mock.Mock(get_device_capability=mock.Mock(return_value=capability))
                with (
                    mock.patch.object(torch, "get_device_module", return_value=module),
                    mock.patch.object(torch.version, "hip", None),
                ):
                    self.assertEqual(grouped_mm_runs(gpu, torch.bfloat16, 64, 256), want, capability)

    def test_under_autocast_the_grouped_kernel_runs_cast_and_reads_no_sizes(self):
        """Where the grouped kernel runs in bf16 (an sm90 GPU; this CPU standing in), the layer under bf16 autocast
        runs it on bf16 operands with autocast off (autocast has no rule for it: before, it ran the loop there),
        and the one-rank dispatch reads no group sizes on the host. On CPU the kernel and the loop give the same
        bits: output and every gradient."""
        x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
        grouped = torch._grouped_mm
        runs = []

        def spy(a, b, **kw):
            runs.append((a.dtype, b.dtype, torch.is_autocast_enabled("cpu")))
            return grouped(a, b, **kw)

        out = {}
        for fast in (False, True):
            layer = moe()
            reads = mock.Mock(side_effect=lambda counts, n: counts.tolist())
            with (
                mock.patch.object(moe_module.LocalDispatch, "split_sizes", reads),
                mock.patch.object(torch, "_grouped_mm", spy),
                mock.patch.object(moe_module, "grouped_mm_runs", fast_path_here) if fast else contextlib.nullcontext(),
                torch.autocast("cpu", torch.bfloat16),
            ):
                y = layer(x)
            self.assertEqual(reads.call_count, 0 if fast else 1, fast)
            grads = torch.autograd.grad(y.float().sum(), [x, *layer.parameters()])
            out[fast] = (y, *grads)
        self.assertEqual(runs, [(torch.bfloat16, torch.bfloat16, False)] * 2)  # c_fc and c_proj, fast only
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(out[False], out[True])))

    def test_casting_the_rows_before_dispatch_changes_no_bit(self):
        """moe.expert_rows casts the gathered rows to the compute dtype (bf16 under autocast) before they reach
        the experts (under EP, before the all_to_all: half the bytes). The same values reach the experts' first
        matmul, which cast them itself before; backward, that matmul's bf16 input gradient, cast up to fp32
        (exact), reaches the gather in fp32 either way, where a token's k slots are summed as before: output and
        every gradient bit for bit, with and without the early cast."""
        x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(7), requires_grad=True)
        out = []
        for early in (True, False):
            layer = moe()
            late = mock.patch.object(moe_module, "expert_rows", lambda x, order, k: x[order // k])
            with contextlib.nullcontext() if early else late, torch.autocast("cpu", torch.bfloat16):
                y = layer(x)
            out.append((y, *torch.autograd.grad(y.float().sum(), [x, *layer.parameters()])))
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(*out)))

    def test_balancing_loss_and_bias_step(self):
        """aux = the mean over rows of a * E * sum_e f_e P_e on each row (sequence); after balance_experts the bias
        moved by u * sign(mean - load), the loads were the micro-batch's assignments, and every count is zero."""
        a, u = 0.01, 0.001
        model = GPT(config(4, 2, moe_aux_loss_coeff=a, moe_bias_update_rate=u))
        model.init_weights(SEED)
        layer = model.transformer.h[0].mlp
        x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
        from model.moe import SideLosses

        with SideLosses() as side:
            layer(x)
        scores = torch.softmax(x.reshape(-1, 64) @ layer.router.weight.t(), -1)
        chosen, _ = route(scores, layer.expert_bias, 2)
        counts = torch.bincount(chosen.reshape(-1), minlength=4)
        per_row = []  # the loss of each sequence (row): its own assignments' shares and mean scores
        for b in range(2):
            f = torch.bincount(chosen[8 * b : 8 * (b + 1)].reshape(-1), minlength=4).float() / (8 * 2)
            per_row.append(4 * (f * scores[8 * b : 8 * (b + 1)].mean(0)).sum())
        torch.testing.assert_close(side.total, a * torch.stack(per_row).mean(), rtol=1e-6, atol=0)
        stats, aux = balance_experts([(0, layer)])
        self.assertEqual(stats[0, :4].tolist(), counts.tolist())
        load = counts.float()
        torch.testing.assert_close(layer.expert_bias, u * torch.sign(load.mean() - load))
        self.assertEqual(int(layer.load.sum()), 0)

    def test_an_expert_parallel_rank_draws_its_own_slice(self):
        """Each expert is drawn as its own matrix: rank r's experts [r·E/N, (r+1)·E/N) of the full init."""
        cfg = config(8, 2)
        name = "transformer.h.0.mlp.experts.c_fc.weight"
        full = init_parameter(name, (8, 64, 256), cfg, SEED)
        self.assertTrue(torch.equal(init_parameter(name, (8, 64, 256), cfg, SEED, rows=slice(4, 6)), full[4:6]))
        self.assertEqual(len({float(full[e].std()) for e in range(8)}), 8)  # eight different matrices
        self.assertLess(abs(float(full.std()) - 0.02), 0.001)


def dispatch_on_ranks(rank: int, world: int) -> dict[bool, dict]:
    """`dispatch_once` in fp32 and under bf16 autocast, by autocast."""
    return {autocast: dispatch_once(rank, world, autocast) for autocast in (False, True)}


def dispatch_once(rank: int, world: int, autocast: bool) -> dict:
    """Each rank's 16 tokens through one MoE layer with its 2 of 4 experts (EP = 2), and, on the same rank, the
    local dispatch of both ranks' tokens through all 4 experts (what one process computes for them)."""
    import torch.distributed as dist

    from parallel import comm
    from parallel.expert_parallel.dispatch import apply_expert_parallel
    from parallel.mesh import MeshDim

    torch.manual_seed(0)
    whole = moe()
    xs = [torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    x_all = torch.cat(xs).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y_all = whole(x_all)
    dy = torch.cat([torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(20 + r)) for r in range(world)])
    grads_all = torch.autograd.grad(y_all, [x_all, *whole.parameters()], dy)
    ep = MeshDim("ep", world, rank, dist.group.WORLD, None)
    edp = MeshDim("edp", 1, 0, None, None)
    mine = moe()
    wrapper = torch.nn.Module()
    wrapper.config, wrapper.transformer = config(), torch.nn.Module()
    wrapper.transformer.h = torch.nn.ModuleList([torch.nn.Module()])
    wrapper.transformer.h[0].mlp = mine
    apply_expert_parallel(wrapper, ep, edp)
    comm.COUNTER.reset()
    x = xs[rank].clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = mine(x)
    grads = torch.autograd.grad(y, [x, mine.router.weight, *mine.experts.parameters()], dy[2 * rank : 2 * rank + 2])
    rows = slice(2 * rank * 8, (2 * rank + 2) * 8)
    L = slice(2 * rank, 2 * rank + 2)
    n = dict(zip([name for name, _ in whole.named_parameters()], grads_all[1:]))
    # sum_r |G_r x_r^T| of the router weight's gradient, from each token run alone (one row: no summation)
    magnitude = (
        None
        if autocast
        else sum(
            torch.autograd.grad(whole(x_all[b, t].view(1, 1, -1)), whole.router.weight, dy[b, t].view(1, 1, -1))[
                0
            ].abs()
            for b in range(x_all.shape[0])
            for t in range(x_all.shape[1])
        )
    )
    return {
        "y": torch.equal(y, y_all[2 * rank : 2 * rank + 2]),
        "dx": torch.equal(grads[0], grads_all[0][2 * rank : 2 * rank + 2]),
        "experts": all(
            torch.equal(g, n[f"experts.{name}"][L]) for g, (name, _) in zip(grads[2:], mine.experts.named_parameters())
        ),
        "router": (grads[1], n["router.weight"], magnitude),
        "rows": rows,
        "bytes": comm.COUNTER.snapshot().get("all_to_all"),
        "calls": comm.COUNTER.snapshot_calls().get("all_to_all"),
        "load": mine.load.tolist(),
    }


def capturing(graphs: list) -> object:
    """A torch.compile backend that keeps each graph dynamo traces and runs it through AOT autograd, eagerly
    (aot_eager: the custom ops' fake kernels and autograd as inductor would see them, without compiling C++)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


class UnderCompile(unittest.TestCase):
    """The one-rank dispatch inside torch.compile: one graph (fullgraph: a host read of the group sizes, counts'
    tolist, would break it), with torch._grouped_mm in it where the traced kernel takes the dtype (bf16, here under
    autocast), else the per-expert loop as one op (moe.expert_loop, fp32), which reads the sizes when it runs;
    output and gradients the eager dispatch's bits (on the CPU the grouped kernel gives the loop's)."""

    def check(self, autocast: bool, want: str) -> None:
        torch._dynamo.reset()
        layer = moe(E=4)
        g = torch.Generator().manual_seed(8)
        x = torch.randn(24, 64, generator=g, requires_grad=True)
        chosen = torch.randint(0, 4, (24, 2), generator=g)
        chosen[:, 1] = (chosen[:, 0] + 1) % 4
        run = lambda x, chosen: moe_module.LocalDispatch()(layer.experts, x, chosen)  # noqa: E731
        graphs = []
        compiled = torch.compile(run, backend=capturing(graphs), fullgraph=True)
        out = []
        for f in (run, compiled):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = f(x, chosen)
            out.append((y, *torch.autograd.grad(y.float().sum(), [x, *layer.experts.parameters()])))
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(*out)), want)
        targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
        self.assertEqual(len(graphs), 1)
        self.assertIn(want, targets)
        self.assertFalse({"tolist", "item"} & targets, targets)

    def test_bf16_keeps_the_grouped_kernel(self):
        self.check(True, str(torch._grouped_mm))

    def test_fp32_runs_the_loop_as_one_op(self):
        self.check(False, "gpt_moe.expert_loop.default")

    def test_the_loop_op_registration(self):
        """torch.library.opcheck: expert_loop's fake kernel, its autograd (expert_loop_backward) and its schema
        agree with what it runs, an empty group among the experts."""
        g = torch.Generator().manual_seed(9)
        x = torch.randn(20, 64, generator=g, requires_grad=True)
        w = torch.randn(4, 64, 32, generator=g, requires_grad=True)
        ends = torch.tensor([7, 0, 9, 4]).cumsum(0).to(torch.int32)
        torch.library.opcheck(moe_module.expert_loop, (x, w, ends))


class DispatchAcrossRanks(unittest.TestCase):
    """EP = 2 on 2 spawned ranks, 4 experts, k = 2, 16 tokens each, C = 64, fp32 (and under bf16 autocast)."""

    @classmethod
    def setUpClass(cls):
        both = run_distributed(dispatch_on_ranks, 2)
        cls.res, cls.bf16 = [r[False] for r in both], [r[True] for r in both]

    def test_outputs_and_gradients_equal_the_local_dispatch(self):
        """Output, input gradient and the rank's experts' gradients bit-equal to one process's dispatch of both
        ranks' tokens, in fp32 and under bf16 autocast. The router's gradient is dense: each rank's holds its 16
        tokens' sum, and the two sums added differ from one process's sum of all 32 only by order (fp32): within
        2·gamma_33·sum_r |G_r x_r^T|, the terms' magnitudes measured token by token (Higham 4.4; 33: the 32 terms
        and the final addition)."""
        for r in self.res + self.bf16:
            self.assertTrue(r["y"] and r["dx"] and r["experts"])
        total = sum(r["router"][0] for r in self.res)
        _, ref, magnitude = self.res[0]["router"]
        u = 2.0**-24
        bound = 2 * (33 * u / (1 - 33 * u)) * magnitude * (1 + 2 * u)
        self.assertLessEqual(float(((total - ref).abs() - bound).max()), 0.0)
        self.assertGreater(float((total - ref).abs().max()), 0.0)  # the orders differ: the bound is what holds

    def test_all_to_all_bytes_equal_the_formula(self):
        """Per rank, forward: the counts (4 int64), its 16·2 rows out, the rows its experts got back; backward the
        same two row moves: 8·E + 2·(N·k + R)·C·4 bytes, R = the rows that reached this rank's experts."""
        from plan.theory import ep_all_to_all_bytes_per_micro_step

        load = [sum(r["load"][e] for r in self.res) for e in range(4)]  # tokens per expert over both ranks
        for rank, r in enumerate(self.res):
            received = load[2 * rank] + load[2 * rank + 1]
            self.assertEqual(r["bytes"], ep_all_to_all_bytes_per_micro_step(16, 2, 64, 4, 1, received=received))
            self.assertEqual(r["bytes"], 8 * 4 + 2 * (16 * 2 + received) * 64 * 4)
            self.assertEqual(r["calls"], 5)

    def test_under_autocast_the_rows_go_in_bf16(self):
        """Under bf16 autocast every row moves in bf16: the rows out (cast before they are sent, moe.expert_rows;
        ln_2's output is fp32), the experts' outputs back and both gradients: 8·E + 2·(N·k + R)·C·2 bytes, where
        fp32 rows made it 8·E + (N·k·4 + R·2 + R·4 + N·k·2)·C. The same bits as the local dispatch (above)."""
        from plan.theory import ep_all_to_all_bytes_per_micro_step

        load = [sum(r["load"][e] for r in self.bf16) for e in range(4)]
        for rank, r in enumerate(self.bf16):
            received = load[2 * rank] + load[2 * rank + 1]
            self.assertEqual(
                r["bytes"], ep_all_to_all_bytes_per_micro_step(16, 2, 64, 4, 1, dtype_bytes=2, received=received)
            )
            self.assertEqual(r["bytes"], 8 * 4 + 2 * (16 * 2 + received) * 64 * 2)


if __name__ == "__main__":
    unittest.main()
