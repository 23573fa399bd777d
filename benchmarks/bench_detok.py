"""The serving path's detokenisation of a streamed answer (``dllm.serve.server._Text``) against decoding the whole
answer at every piece, with the bundled byte-level BPE tokenizer (LLaDA's and Qwen's format): seconds of CPU per
answer and ids decoded per answer token, for answers arriving one token per step (LLaDA's baseline at one token per
forward) and 32 at a time (a block committed at once).

    python benchmarks/bench_detok.py                       # answers of 512, 2,048 and 8,192 tokens
    python benchmarks/bench_detok.py --lengths 4096 --json out.json
"""

from __future__ import annotations

import argparse
import random
import time

from _common import positive, print_table, write_json

import dllm
from dllm.serve.server import _Text


class _Counting:
    def __init__(self, tok):
        self.tok, self.ids = tok, 0

    def decode(self, ids, **kw):
        self.ids += len(ids)
        return self.tok.decode(ids, **kw)


def _incremental(tok, ids: list[int], step: int) -> tuple[str, float, int]:
    counting = _Counting(tok)
    text = _Text(counting, set(), [])
    t0 = time.perf_counter()
    out = "".join(text.feed(ids[i:i + step]) for i in range(0, len(ids), step)) + text.feed([], True)
    return out, time.perf_counter() - t0, counting.ids


def _whole(tok, ids: list[int], step: int) -> tuple[str, float, int]:
    """Every piece decodes the answer so far and sends what its text adds."""
    sent, decoded = "", 0
    t0 = time.perf_counter()
    for i in range(step, len(ids) + step, step):
        part = ids[:i]
        decoded += len(part)
        text = tok.decode(part, skip_special_tokens=True)
        if i < len(ids):  # an unfinished character waits for its next ids; the whole answer's decode is final
            text = text.rstrip("\ufffd")
        sent += text[len(sent):]
    return sent, time.perf_counter() - t0, decoded


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=positive, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--steps", type=positive, nargs="+", default=[1, 32], help="tokens per piece")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tok = dllm.load_model("llada-tiny").tokenizer
    words = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    rng = random.Random(0)
    rows = []
    for n in a.lengths:
        ids = [rng.choice(words) for _ in range(n)]
        want = tok.decode(ids, skip_special_tokens=True)
        for step in a.steps:
            inc, t_inc, d_inc = _incremental(tok, ids, step)
            whole, t_whole, d_whole = _whole(tok, ids, step)
            if inc != want or whole != want:
                raise SystemExit(f"the streamed text differs from the answer's decode (length {n}, step {step})")
            rows.append({"tokens": n, "per_piece": step, "incremental_s": round(t_inc, 4),
                         "whole_s": round(t_whole, 4), "speedup": round(t_whole / t_inc, 1),
                         "ids_decoded_per_token": round(d_inc / n, 1),
                         "whole_ids_decoded_per_token": round(d_whole / n, 1)})
    print_table(["answer tokens", "tokens per piece", "incremental (s)", "whole answer per piece (s)", "speed-up",
                 "ids decoded per token", "(whole)"],
                [[r["tokens"], r["per_piece"], r["incremental_s"], r["whole_s"], f'{r["speedup"]}x',
                  r["ids_decoded_per_token"], r["whole_ids_decoded_per_token"]] for r in rows])
    write_json(a.json, rows)
    return rows


if __name__ == "__main__":
    main()
