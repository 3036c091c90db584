"""Options several commands share, so that their choices, defaults and help read the same
everywhere."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import click

from numa_moe.formats import QUANT_FORMATS
from numa_moe.placement.pages import PAGE_CHOICES

# The expert weight formats the commands take: the quantized ones (numa_moe.formats), and
# bf16 besides where a command also runs unquantized experts.
QUANT_FORMAT_CHOICES = list(QUANT_FORMATS)
WEIGHT_FORMAT_CHOICES = ["bf16", *QUANT_FORMATS]

# numa_moe.layer.kernels.ISAS, spelled out here so that building the CLI imports no native code
# (tests/test_cli_options.py checks the two agree).
ISAS = ("ref", "avx2", "avx512", "amx_model", "amx", "avx2_emulated", "avx512_emulated")

ISA_HELP = ("Kernel instruction set: ref (portable C++), avx2 (FMA; vpmaddubsw for int8/int4), avx512 "
            "(AVX-512 BF16 vdpbf16ps; VNNI vpdpbusd for int8/int4), amx (AMX tiles: tdpbf16ps, tdpbssd for "
            "int8/int4), amx_model (the AMX kernel source run on a software model of the AMX "
            "instructions, for testing; slow), avx2_emulated and avx512_emulated (those kernel sources over "
            "SIMDe's portable intrinsics, in test builds only; slow).")

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


# ------------------------------------------------------------------ output files

def _what_is(path: Path) -> str | None:
    """None for a regular file (or nothing there), else what the path is."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None  # nothing there yet (a parent that is a file is reported apart)
    except OSError as err:
        return f"unusable ({err.strerror})"
    if stat.S_ISREG(mode):
        return None
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def check_output(path: str, option: str, create_parents: bool = False) -> Path:
    """The real file an output option names, refused (one-line click error, exit 1) when it
    cannot be written as a regular file: a device, a pipe such as /dev/stdout, a
    directory, a parent that is a file or (unless ``create_parents``) missing.

    Symlinks are followed: the file written is the link's target, the link is kept.
    Call it before the work, so that a bad path fails in a second, not after the job.
    """
    given = Path(path)
    what = _what_is(given)
    if what is not None:
        raise click.ClickException(f"cannot write {option} {path}: it is {what}; give the "
                                   "path of a regular file")
    target = Path(os.path.realpath(given))
    special = (("proc",), ("dev",), ("sys",))
    if target.parts[1:2] in special or Path(os.path.abspath(given)).parts[1:2] in special:
        # /dev/stdout redirected to a file resolves to /proc/PID/fd/...: not a file to replace.
        raise click.ClickException(f"cannot write {option} {path}: it is not a regular file "
                                   "on a disk (/dev, /proc, /sys); give the path of one")
    folder = target.parent
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise click.ClickException(f"cannot write {option} {path}: {parent} is not a "
                                           "directory")
            break
    if not folder.exists() and not create_parents:
        raise click.ClickException(f"cannot write {option} {path}: the folder {folder} does "
                                   "not exist")
    return target


def check_apart(path: str, option: str, sources) -> None:
    """Refuse (one-line click error) an output that is, contains or lies inside one of
    ``sources``, the files and directories the command reads (links resolved)."""
    from numa_moe.checkpoints.safetensors import overlapping_source

    source = overlapping_source(path, sources)
    if source is not None:
        raise click.ClickException(f"cannot write {option} {path}: it would replace or lie inside "
                                   f"{source}, which this command reads; give a path apart from it")


@contextlib.contextmanager
def output_file(path: str, option: str, create_parents: bool = False):
    """Yields a temporary path beside the output; when the block ends without an
    exception the temporary file is fsynced and renamed onto the output (atomic), else
    it is removed (also on SIGINT and SIGTERM, which the CLI turns into exceptions).
    OS errors become one-line click errors naming the option and the path."""
    target = check_output(path, option, create_parents)
    folder = target.parent
    tmp = None
    try:
        if not folder.exists():
            folder.mkdir(parents=True, exist_ok=True)
            click.echo(f"created folder {folder} for {option}", err=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would surprise a user sharing the file
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as err:
        raise click.ClickException(f"cannot write {option} {path}: {err.strerror or err}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_output(path: str, text: str, option: str, create_parents: bool = False) -> None:
    """``text`` written atomically to the file ``option`` names (see ``output_file``)."""
    with output_file(path, option, create_parents) as tmp:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(text)
