#!/usr/bin/env python3
"""What a grammar costs llama.cpp's sampler, as a function of its size: the measurement behind
``mars_local.speculate.grammar.MAX_GRAMMAR_ALTERNATIVES`` and ``MAX_GRAMMAR_ELEMENTS``.

    .venv/bin/python benchmarks/grammar_cost.py [MODEL.gguf] [--sizes 250,1000,2048,4000] [--family enum ...]

For each family of grammars and each size N it builds the GBNF, then times what the engine
does with it: ``check_grammar_text`` (our static check), creating ``GrammarState`` (llama.cpp
parses the grammar and opens its first parse stacks) and ``GrammarState.mask`` over a full
vocabulary row (the first token's mask; ``need=0``, the path taken when the best candidates
are not allowed), then the mask after one accepted token.  Columns: the text's bytes, rules
(``::=``), ``|`` count, and our two estimates (``GrammarCost``): alternatives open at once
and elements after repetitions; the last column is the first mask's milliseconds per open
alternative.  Families:

  enum      a JSON schema {"enum": [N strings]} (converted by llama-cpp-python)
  anyOf     a JSON schema {"anyOf": [N one-property objects]}
  alts      root ::= "w0" | "w1" | ... (N literal alternatives)
  class     root ::= [a-z] "w0" | [a-z] "w1" | ... (each starts with a class)
  dots      root ::= . . . . "w0" | ... (most tokens are walked 4-5 characters into every alternative)
  star      root ::= [^"]* "w0" | ... (each alternative a repetition: two stacks)
  seq       N two-way rules in sequence: root ::= r0 r1 ...; ri ::= "a" | "b"
  chain     N rules deep: ri ::= "x" ri+1
  optional  N optional items in a row: root ::= "a0"? "a1"? ... "z"
  groups    root ::= () () () ... (N empty groups: rules, no alternatives)
  repeat    root ::= "<N bytes>"{1000} (repetition: elements, memory)

The model's vocabulary size matters (the mask checks each token against each stack): the
default is the bundled SmolLM2-135M (49,152 tokens).  Times are this thread's CPU time (llama.cpp's
grammar sampler is single-threaded), so other load on the machine changes them little.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _words(n: int) -> list[str]:
    return [f"value{i:06d}" for i in range(n)]


def families():
    from mars_local.speculate.grammar import _schema_gbnf as schema  # the converter's GBNF, before our limit

    return {
        "enum": lambda n: schema({"enum": _words(n)}),
        "anyOf": lambda n: schema({"anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(n)
        ]}),
        "alts": lambda n: "root ::= " + " | ".join(f'"{w}"' for w in _words(n)),
        "class": lambda n: "root ::= " + " | ".join(f'[a-z] "{w}"' for w in _words(n)),
        "dots": lambda n: "root ::= " + " | ".join(f'. . . . "{w}"' for w in _words(n)),
        "star": lambda n: "root ::= " + " | ".join(f'[^"]* "{w}"' for w in _words(n)),
        "seq": lambda n: "root ::= " + " ".join(f"r{i}" for i in range(n)) + "\n"
        + "\n".join(f'r{i} ::= "a" | "b"' for i in range(n)),
        "chain": lambda n: "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "y"',
        "optional": lambda n: "root ::= " + " ".join(f'"a{i}"?' for i in range(n)) + ' "z"',
        "groups": lambda n: "root ::= " + "() " * n + '"z"',
        "repeat": lambda n: 'root ::= "' + "a" * n + '"{1000}',
    }


def measure(model, text: str, row):
    import numpy as np

    from mars_local.speculate.grammar import GrammarState, _init_grammar
    from mars_local.speculate.grammar_check import check_grammar_text, grammar_cost

    t0 = time.thread_time()
    try:
        check_grammar_text(text)
        verdict = "ok"
    except Exception as exc:  # noqa: BLE001 - the verdict is reported, the cost is measured anyway
        verdict = "refused"
        if "too complex" not in str(exc) and "too large" not in str(exc):
            verdict = f"refused: {exc}"
    t_check = time.thread_time() - t0
    cost = grammar_cost(text)
    import llama_cpp

    t0 = time.thread_time()  # llama.cpp alone (past our limits too): parse, first stacks
    g = GrammarState(model, _handle=_init_grammar(llama_cpp, model.vocab, text.encode("utf-8"), b"root"))
    t_init = time.thread_time() - t0
    r = row.copy()
    t0 = time.thread_time()
    g.mask(r)
    t_mask = time.thread_time() - t0
    ok = np.flatnonzero(np.isfinite(r))
    t_mask2 = float("nan")
    if len(ok):
        g.accept(int(ok[np.argmax(r[ok])]))
        r = row.copy()
        t0 = time.thread_time()
        g.mask(r)
        t_mask2 = time.thread_time() - t0
    g.close()
    return cost, verdict, t_check, t_init, t_mask, t_mask2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--sizes", default="250,1000,2048,4000")
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = ap.parse_args(argv)

    import numpy as np

    from mars_local.llama.runtime import Model

    path = args.model
    if path is None:
        from mars_local.models.registry import load_registry, model_path

        path = model_path(load_registry().get("smollm2-135m"), "target")
    model = Model(path)
    row = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
    fams = families()
    names = args.family or list(fams)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# {Path(path).name}: vocabulary {model.n_vocab} tokens", flush=True)
    if not args.json:
        print("| family | N | bytes | rules | `\\|` | open alts | elements | check | verdict | create ms "
              "| 1st mask ms | 2nd mask ms | ms/alt |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for fam in names:
        for n in sizes:
            text = fams[fam](n)
            cost, verdict, t_check, t_init, t_mask, t_mask2 = measure(model, text, row)
            rec = dict(family=fam, n=n, bytes=len(text.encode()), rules=text.count("::="), bars=text.count("|"),
                       alternatives=cost.alternatives, elements=cost.elements, check_ms=t_check * 1e3,
                       verdict=verdict, create_ms=t_init * 1e3, mask1_ms=t_mask * 1e3, mask2_ms=t_mask2 * 1e3)
            if args.json:
                print(json.dumps(rec), flush=True)
                continue
            print(f"| {fam} | {n} | {rec['bytes']} | {rec['rules']} | {rec['bars']} | {cost.alternatives} "
                  f"| {cost.elements} | {t_check * 1e3:.1f} | {verdict} | {t_init * 1e3:.1f} | {t_mask * 1e3:.1f} "
                  f"| {t_mask2 * 1e3:.1f} | {t_mask * 1e3 / max(cost.alternatives, 1):.3f} |", flush=True)


if __name__ == "__main__":
    main()
