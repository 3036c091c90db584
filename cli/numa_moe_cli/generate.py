"""``numa-moe generate``: a greedy CPU decode loop with both kernels against the same
transformers model unpatched (see numa_moe.apps.generate.run_generate)."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from numa_moe_cli.options import check_output, isa_option, write_output, wrote

LIKE = ("qwen3-30b-a3b", "qwen3-235b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b")  # the qwen3_moe / mixtral / gpt_oss entries of MODEL_SPECS


@click.command("generate")
@click.option("--like", default="qwen3-30b-a3b", show_default=True, type=click.Choice(LIKE),
              help="model whose shapes (hidden size, heads, head size, expert width) the random model takes")
@click.option("--layers", default=4, show_default=True, type=click.IntRange(1), help="decoder layers")
@click.option("--tokens", "-t", default=64, show_default=True, type=click.IntRange(1), help="new tokens, greedy")
@click.option("--experts", type=click.IntRange(1), default=None, help="routed experts per layer (default: the "
              "model's default for generated checkpoints, 16 for qwen3-30b-a3b)")
@click.option("--vocab", default=4096, show_default=True, type=click.IntRange(16),
              help="vocabulary size (small, so that the LM head does not dominate the step)")
@click.option("--prompt", "prompt_tokens", default=16, show_default=True, type=click.IntRange(1),
              help="random prompt tokens")
@click.option("--baseline", type=click.Choice(["sdpa", "eager"]), default=None,
              help="attention implementation of the unpatched transformers run [default: sdpa; gpt-oss: "
                   "eager, its only one, kept in the patched run too (attention sinks)]")
@isa_option("the fastest (amx > avx512 > avx2 > ref)")
@click.option("--seed", default=0, show_default=True, type=int, help="seed of the weights and the prompt")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the report as JSON to this file.")
def generate_command(like, layers, tokens, experts, vocab, prompt_tokens, baseline, isa, seed, json_path):
    """Greedy decoding on transformers' model of a MoE shape (random weights), unpatched and
    with numa-moe's experts and decode attention: tokens/s of both, whether the tokens
    agree, and the share of the step in experts, attention and the rest."""
    from numa_moe.apps.generate import format_report, run_generate

    if json_path:
        check_output(json_path, "--json")
    try:
        report = run_generate(like, layers, tokens, experts, vocab, prompt_tokens, seed, baseline, isa=isa,
                              echo=click.echo)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_report(report))
    if json_path:
        data = asdict(report)
        data["speedup"] = report.speedup
        write_output(json_path, json.dumps(data, indent=2), "--json")
        wrote(json_path)
