"""What the generating commands show: chunks as they stream (coloured by origin if asked),
the statistics summary, the note of a full context.  Imports nothing of the CLI.
"""

from __future__ import annotations

import sys
from typing import Optional

KIND_STYLE = {"draft": "green", "relaxed": "bold yellow", "target": ""}


def chunk_printer(show_acceptance: bool, eng):
    """Stream chunks to stdout, coloured by how each token was produced if asked
    (green = accepted draft, yellow = accepted only by MARS, plain = target)."""
    if not show_acceptance:
        def plain(chunk):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()

        return plain
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)

    def coloured(chunk):
        pieces = [eng.piece(tok).decode("utf-8", "replace") for tok in chunk.tokens]
        line = Text()
        if "".join(pieces) != chunk.text:
            # text held back (a character split across tokens) or cut at a stop string:
            # the chunk's text is what is shown, uncoloured
            line.append(chunk.text)
        else:
            for piece, kind in zip(pieces, chunk.kinds):
                line.append(piece, style=KIND_STYLE.get(kind, ""))
        console.print(line, end="")

    return coloured


def context_full_note(eng) -> str:
    return f"note: stopped: the context ({eng.n_ctx} tokens) is full; a larger -c makes room"


def format_stats(s, choice, context: Optional[str] = None) -> str:
    """An ollama-style summary with the speculation counters (``context``: see
    :meth:`mars_local.cli.flags.GenOptions.context_line`)."""
    share = f", {s.relaxed_share:.0%} of accepts relaxed" if s.n_accepted else ""
    # stopped before the first token: the prompt's rest may never have been evaluated, cached or not
    rest = " before the interruption" if s.stop_reason == "interrupted" and not s.n_generated else \
        ", rest reused from cache"
    lines = [
        f"model:                {choice.label} (drafter: {choice.drafter})",
        *([f"context size:         {context}"] if context else []),
        f"prompt eval count:    {s.n_prompt} token(s) ({s.n_prompt_evaluated} evaluated{rest})",
        f"prompt eval duration: {s.time_prompt_s * 1000:.1f} ms",
        f"eval count:           {s.n_generated} token(s)",
        f"eval duration:        {s.time_decode_s * 1000:.1f} ms"
        + (f" (+ {s.time_calibrate_s * 1000:.0f} ms timing verify windows once)" if s.time_calibrate_s else ""),
        f"eval rate:            {s.tokens_per_second:.2f} tokens/s",
        f"target forwards:      {s.n_rounds}",
        f"drafted / accepted:   {s.n_drafted} / {s.n_accepted} "
        f"(acceptance {s.acceptance_rate:.1%}, relaxed {s.n_relaxed}{share})",
        f"mean accepted length: {s.mean_accepted_length:.2f} tokens per target forward",
        "time split:           target {:.1f} ms, draft {:.1f} ms, verify {:.1f} ms ({}, {:.1%} of decode)".format(
            s.time_target_s * 1000, s.time_draft_s * 1000, s.time_verify_s * 1000, s.verify_backend, s.verify_share
        ),
        f"draft length:         {'adaptive' if s.adaptive else 'fixed'}"
        + (f", mean k {sum(s.k_per_round) / len(s.k_per_round):.2f}" if s.k_per_round else ""),
        f"stop reason:          {s.stop_reason or 'interrupted'}",
    ]
    return "\n".join(lines)
