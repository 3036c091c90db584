"""`numa-moe serve-check`: tiny Qwen3-MoE, Mixtral and DeepSeek-V2 models through vLLM with and
without the numa-moe plugin, greedy tokens and logprobs compared (numa_moe.integrations.vllm_check).
Runs in the vLLM venv (tools/setup-vllm.sh)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click


@click.command("serve-check")
@click.option("--family", "families", type=click.Choice(["qwen3_moe", "mixtral", "deepseek_v2", "gpt_oss"]),
              multiple=True, help="Model families to build and serve (default: all three).")
@click.option("--mode", "modes", type=click.Choice(["eager", "compiled"]), multiple=True,
              help="vLLM execution modes (default: eager). 'compiled' is vLLM's torch.compile mode.")
@click.option("--prompts", "n_prompts", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Random prompts (8 words each) per run.")
@click.option("--tokens", "max_tokens", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Greedy tokens generated per prompt.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where the models, requests and logs go (default: a temporary directory, removed after).")
def serve_check_command(families, modes, n_prompts, max_tokens, workdir):
    """Serve tiny generated MoE models with vLLM with and without the numa-moe plugin and
    compare their greedy tokens and logprobs. Exit status 1 when a run differs away from a
    near-tie or the plugin's kernels did not run."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise click.ClickException("vLLM is not installed in this environment: set up its venv with "
                                   "`bash tools/setup-vllm.sh` and run `.venv-vllm/bin/numa-moe serve-check`")
    from numa_moe.integrations import vllm_check

    with tempfile.TemporaryDirectory(prefix="numa-moe-serve-check-") as scratch:
        root = Path(workdir) if workdir else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        try:
            rows = vllm_check.serve_check(root, families or vllm_check.FAMILIES, modes or ("eager",),
                                          n_prompts=n_prompts, max_tokens=max_tokens)
        except RuntimeError as err:
            raise click.ClickException(str(err))
    click.echo(f"{'model':<10} {'mode':<9} {'tokens equal':>13} {'max |dlogprob|':>15} {'numa-moe calls':>15}  experts (stock -> plugin)")
    ok = True
    for row in rows:
        same = sum(row["matched"])
        total = row["tokens"] * len(row["matched"])
        verdict = "" if row["equal"] else (" (diverged at near-ties only)" if row["ties_only"] else " DIFFERENT")
        ran = row["numa_moe_calls"] > 0 and row["plugin_experts"] == ["NumaMoEExperts"]
        ok = ok and (row["equal"] or row["ties_only"]) and ran
        click.echo(f"{row['family']:<10} {row['mode']:<9} {f'{same}/{total}':>13} {row['max_logprob_diff']:>15.4f} "
                   f"{row['numa_moe_calls']:>15}  {','.join(row['stock_experts'])} -> "
                   f"{','.join(row['plugin_experts'])}{verdict}")
    if not ok:
        raise SystemExit(1)
