"""Options several commands share, so that their choices, defaults and help read the same
everywhere."""

from __future__ import annotations

import click

from numa_moe.pages import PAGE_CHOICES

# numa_moe.kernels.ISAS, spelled out here so that building the CLI imports no native code
# (tests/test_cli_options.py checks the two agree).
ISAS = ("ref", "avx2", "avx512", "amx_model", "amx")

ISA_HELP = ("Kernel instruction set: ref (portable C++), avx2, avx512 (AVX-512 BF16 vdpbf16ps), "
            "amx (AMX tiles), amx_model (the AMX kernel source run on a software model of the AMX "
            "instructions, for testing; slow).")

PAGES = PAGE_CHOICES
DEFAULT_PAGE = "4k"
# Why placement commands default to 4k: MPOL_INTERLEAVE spreads base pages, and 4 KB
# needs no transparent huge pages, so the tables hold on every Linux host.
PAGE_HELP = ("Page size the weights are interleaved by: 4k (base pages, the interleave unit that "
             "needs no transparent huge pages, hence the default) or 2m (transparent huge pages).")


def isa_option(default_text: str):
    """--isa with the known ISAs as choices; `default_text` says what no --isa means."""
    return click.option("--isa", type=click.Choice(ISAS), default=None,
                        help=f"{ISA_HELP} Default: {default_text}.")


def page_option(default: str = DEFAULT_PAGE, help_text: str = PAGE_HELP):
    return click.option("--page", type=click.Choice(PAGES), default=default, show_default=True, help=help_text)


def wrote(path: str, what: str = "") -> None:
    """Says where a --json/-o writer wrote (on stderr, so that stdout stays the report)."""
    click.echo(f"wrote {what + ' ' if what else ''}{path}", err=True)
