"""Host synchronisations per decode step (what makes the host wait for a GPU).

The decode loop itself synchronises once per step (the next window, whether rows are left, whether the logits
were finite, and a cache's plan for the next step: partial or full, the size of the largest active set); some samplers add
their own (listed below with their budget). The counts are taken on CPU by counting the calls that would
synchronise on CUDA (``tests/sync_counter.py``): a new ``.item()``, ``int(tensor)``, ``nonzero`` or
boolean-mask index inside the loop makes these tests fail.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ragged_prompts
from helpers_parity import cached_model
from sync_counter import syncs_per_step

import dllm
import dllm.ops as dllm_ops
from dllm.caches import CACHES
from dllm.samplers import SAMPLERS, get_sampler

# Samplers with synchronisations of their own, and the most they may add per step (measured, rounded up):
# the guided sampler's reads of its verification rounds (one per guide forward and one to end the step: variable-length
# verification; the transformers guide's own mask checks at a prefill besides). Dream's masked-position scoring,
# Prophet's gap and fill, KLASS's lazy KL history and AdaBlock's block decision synchronise on the CPU only (on CUDA
# every window position: ops.dense_window).
EXTRA = {"guided": 3}
DREAM = [n for n in SAMPLERS if n.startswith("dream")]
APPROX_CACHES = [c for c in CACHES if c not in ("none", "elastic", "block")]  # block: test_sdar.py


def _run(model, name, cache="none", **kw):
    sampler = get_sampler(name, **({"delimiters": (5, 6, 7)} if name == "adablock" else {}), **kw)
    prompts = ragged_prompts(3, 1)
    return syncs_per_step(lambda: dllm.generate(model, prompts, gen_length=16, block_length=8, steps=16,
                                                sampler=sampler, cache=cache, seed=1))


@pytest.fixture
def dense_window(monkeypatch):
    """Dream, Prophet, KLASS and AdaBlock compute every window position, as they do on CUDA (no data-dependent
    shapes)."""
    monkeypatch.setattr(dllm_ops, "dense_window", lambda logits: True)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_loop_synchronises_once_per_step(family, dense_window):
    model = cached_model(family, 0)
    for name in SAMPLERS:
        for t in (0.0, 0.7):
            if t and "temperature" not in SAMPLERS[name].params():
                continue
            per_step, where, steps = _run(model, name, **({"temperature": t} if t else {}))
            assert steps > 0
            assert per_step <= 1 + EXTRA.get(name, 0), (name, t, per_step, where.most_common(4))
            if name not in EXTRA:
                assert per_step == 1, (name, t, where.most_common(4))


@pytest.mark.parametrize("cache", APPROX_CACHES)
def test_a_cache_adds_no_synchronisation(cache, dense_window):
    """The cache's plan for the next step (partial or full, largest active set) is read in the loop's own sync."""
    for family in ("llada", "dream"):
        model = cached_model(family, 0)
        for name in ("llada", "threshold", "credit", "localleap", "eoser", "dream") if family == "dream" else \
                ("llada", "threshold", "credit", "localleap", "eoser"):
            per_step, where, _ = _run(model, name, cache)
            assert per_step == 1, (family, name, cache, per_step, where.most_common(4))


def test_elastic_cache_synchronises_per_layer():
    """Elastic-Cache decides its refresh layer by layer (the drift test), as the reference does with .item():
    at most one per layer on top of the partial forward's."""
    model = cached_model("llada", 0)
    per_step, where, _ = _run(model, "threshold", "elastic")
    assert per_step <= 2 + 4 * model.config.n_layers, where.most_common(6)


def test_elastic_cache_on_the_graph_path_synchronises_a_fixed_number_of_times_per_step():
    """On the graph path Elastic-Cache's partial forwards run speculatively: the drift tests' read after the forward
    (twice where it stopped early and resumed) and the step's own, which carries the next plan's numbers (its active
    rows and window), whatever the number of layers (the eager path synchronises per layer, above), on a model whose
    drift tests fail at various layers."""
    from test_graphs import deep_model

    prompts = ragged_prompts(3, 1)
    for layers in (2, 6):
        model = deep_model("llada", layers=layers)
        per_step, where, steps = syncs_per_step(lambda m=model: dllm.generate(
            m, prompts, gen_length=16, block_length=8, steps=16, sampler="threshold", cache="elastic", seed=1,
            graphs="on"))
        assert per_step <= 3, (layers, per_step, where.most_common(6))


def test_dense_window_samplers_decode_what_their_sparse_path_decodes(monkeypatch):
    """Dream, Prophet, KLASS and AdaBlock on CUDA compute every window position (no host synchronisation); on the CPU
    only where it matters: the same tokens and statistics, greedy and sampled, with Prophet's early commits firing
    (low gap thresholds) and not, over each of its spans, KLASS's stable commits (its CPU path's chunked pass off, as
    on CUDA) and AdaBlock's blocks ended at delimiters."""
    from dllm.samplers.presets import KLASSSampler

    monkeypatch.setattr(KLASSSampler, "_chunked", lambda self, logits, ctx: False)
    prompts = ragged_prompts(3, 1)
    runs = [("dream", name, {}) for name in DREAM]
    runs += [("llada", "prophet", dict(early=e, mid=e, late=e, span=span))
             for e in (0.5, 7.5) for span in ("region", "masked", (0, 8))]
    runs += [(family, "klass", dict(conf_threshold=c, kl_threshold=k, history=h))
             for family in ("llada", "dream") for c, k, h in ((0.3, 0.05, 2), (0.1, 0.5, 3))]
    runs += [("llada", "adablock", dict(delimiters=d, delimiter_threshold=0.0)) for d in ((5, 6, 7), tuple(range(3, 60)))]
    fired = ready = ended = 0
    for family, name, params in runs:
        model = cached_model(family, 0)
        for t in (0.0, 0.7):
            s = get_sampler(name, temperature=t, **params)
            kw = dict(gen_length=16, steps=16, sampler=s, seed=1, **({"block_length": 8} if family == "llada" else {}))
            sparse = dllm.generate(model, prompts, **kw)
            with monkeypatch.context() as m:
                m.setattr(dllm_ops, "dense_window", lambda logits: True)
                dense = dllm.generate(model, prompts, **kw)
            assert torch.equal(sparse.sequences, dense.sequences), (name, params, t)
            assert repr(sparse.stats.trace) == repr(dense.stats.trace), (name, params, t)  # every step's, nan too
            early = [r["early_commit"] for r in sparse.stats.trace if "early_commit" in r]
            fired += sum(any(e) for e in early) if name == "prophet" else 0
            ready += sum(sum(r["klass_ready"]) for r in dense.stats.trace) if name == "klass" else 0
            ended += sum(sum(r["delimiter_block"]) for r in dense.stats.trace) if name == "adablock" else 0
    assert fired > 0 and ready > 0 and ended > 0  # Prophet's early commits, KLASS's stable commits, AdaBlock's ends


def test_the_counter_sees_a_synchronisation(monkeypatch):
    """The counter is not vacuous: an added .item() in a sampler step is counted."""
    model = cached_model("llada", 0)
    base, _, _ = _run(model, "threshold")
    from dllm.samplers.composed import ComposedSampler

    orig = ComposedSampler.step

    def step(self, logits, ctx):
        logits.amax().item()
        return orig(self, logits, ctx)

    monkeypatch.setattr(ComposedSampler, "step", step)
    more, where, _ = _run(model, "threshold")
    assert more == base + 1, where


def test_a_generations_output_reads_its_trace_in_a_few_copies_whatever_its_steps():
    """The result's per-step trace (a few tensors per step on the device) is read in one copy per dtype, not one per
    tensor: the output's synchronising calls do not grow with the steps, and its records are what reading each tensor
    with ``tolist`` gives."""
    import importlib

    from sync_counter import SyncCounter

    G = importlib.import_module("dllm.generate")
    model = cached_model("llada", 0)
    seen = {}
    orig = G.Decoder.output

    def counted(self, st):
        with SyncCounter() as c:
            out = orig(self, st)
        seen["syncs"], seen["steps"] = c.count, len(st.trace)
        seen["plain"] = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in rec.items()}
                         for rec in st.trace]
        return out

    G.Decoder.output = counted
    try:
        counts = []
        for steps in (8, 32):
            out = dllm.generate(model, ragged_prompts(3, 1), gen_length=32, block_length=8, steps=steps,
                                sampler="llada", cache="dual", seed=1)
            assert seen["steps"] == steps and out.stats.trace == seen["plain"]
            kinds = {type(x) for rec in out.stats.trace for v in rec.values() if isinstance(v, list) for x in v}
            assert {bool, int, float} <= kinds, kinds  # several dtypes, each read in one copy
            counts.append(seen["syncs"])
    finally:
        G.Decoder.output = orig
    assert counts[0] == counts[1] <= 12, counts



def test_a_served_step_synchronises_once(dense_window, monkeypatch):
    """The serving engine reads its rows' tokens, whether each is finished and its forwards in the decoder's own
    synchronisation (``Decoder.reads``): a served step (the decode step, the streamed pieces, the answers of the rows
    that finished) synchronises once, with and without the graph path and the step graphs, up to the step where the
    batch's rows finish and leave."""
    import importlib

    from sync_counter import SyncCounter

    from dllm.serve import Engine

    monkeypatch.setattr(importlib.import_module("dllm.generate"), "_host_check_free", lambda t: False)
    model = dllm.load_model("llada-tiny", dtype="float32")
    orig = Engine._step_group
    for sampler, graphs in (("llada", "off"), ("fast-dllm", "off"), ("fast-dllm", "on")):
        eng = Engine(model, max_rows=4, graphs=graphs)
        hs = [eng.submit("What is 12 + 30?", gen_length=16, block_length=8, sampler=sampler, sample=k)
              for k in range(2)]
        counts = []

        def counted(self, group, counts=counts):
            with SyncCounter() as c:
                orig(self, group)
            counts.append((c.count, c.where))

        Engine._step_group = counted
        try:
            eng.run_until_idle()
        finally:
            Engine._step_group = orig
        assert all(h.result(timeout=0).finish_reason in ("stop", "length") for h in hs)
        assert len(counts) >= 2 and eng.stats()["joins"] == 0
        assert all(n == 1 for n, _ in counts), (sampler, graphs, [(n, w.most_common(3)) for n, w in counts if n != 1])


def test_adablock_with_many_delimiters_synchronises_once_per_step(dense_window, monkeypatch):
    """A real tokenizer's newline delimiters are hundreds of ids: AdaBlock looks them up in a table (one gather), not
    with ``torch.isin``, which sorts many ids with ``unique`` and synchronises on CUDA (the counter sees it: with
    ``isin`` put back, one more per step)."""
    model = cached_model("llada", 0)
    many = tuple(range(10, 60))  # more than isin compares by broadcasting for this window

    def run():
        sampler = get_sampler("adablock", delimiters=many)
        return syncs_per_step(lambda: dllm.generate(model, ragged_prompts(3, 1), gen_length=16, block_length=8,
                                                    steps=16, sampler=sampler, cache="dual", seed=1))

    per_step, where, steps = run()
    assert steps > 0 and per_step == 1, where.most_common(4)

    def isin_table(ids, size, device):  # the table's answer through torch.isin, as the lookup was written before
        class Lookup:
            def __getitem__(self, x):
                return torch.isin(x, torch.tensor(ids, device=device))
        return Lookup()

    monkeypatch.setattr(dllm_ops, "id_table", isin_table)
    more, where, _ = run()
    assert more > 1 and any(k[0] == "isin[sorting]" for k in where), where.most_common(4)
