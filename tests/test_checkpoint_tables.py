"""Tables of a checkpoint (headers only) and the CLI commands make-checkpoint/tables/inspect."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.placement.segments import SegmentTable
from numa_moe.layer.store import checkpoint_tables
from numa_moe.checkpoints.synthetic import make_checkpoint
from numa_moe_cli.main import cli

BITS = {"bf16": 16, "int8": 8, "int4": 4, "fp32": 32, "mxfp4": 4, "e8m0": 8}


def _owner_by_rule(rows, cols, bits, page_bytes, nodes):
    """Node of every element of a row-major matrix starting page-aligned at node nodes[0]:
    element (r, k) is at byte (r * cols + k) * bits / 8."""
    byte = (np.arange(rows * cols, dtype=np.int64) * bits) // 8
    return np.asarray(nodes)[(byte // page_bytes) % len(nodes)].reshape(rows, cols)


def _owner_by_table(table):
    owner = np.full((table.rows, table.cols), -1, dtype=np.int64)
    for node, segments in table.segments.items():
        for s in segments:
            rows = s.row0 + s.row_stride * np.arange(s.nrows)
            assert np.all(owner[rows, s.k0:s.k1] == -1), "element covered twice"
            owner[rows, s.k0:s.k1] = node
    return owner


@pytest.mark.parametrize("nodes", [(0,), (0, 1), (0, 1, 2), (1, 3, 4, 6)])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_tables_follow_interleave_rule_of_stacked_layout(tmp_path, rng, nodes, fmt):
    H, I, E = 96, 40, 3  # rows of 192/96/48 bytes: pages cut rows in the middle
    directory = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 2, E, int(rng.integers(1 << 31)),
                                hidden_size=H, intermediate_size=I, progress=False)
    ck = open_checkpoint(directory)
    tables = checkpoint_tables(ck, nodes, page=4096, fmt=fmt, group=8)
    assert set(tables) == {0, 1}
    shapes = {"gate": (E * I, H), "up": (E * I, H), "down": (E * H, I)}
    page_bytes = 4096 if fmt == "bf16" else 256  # smaller pages for a tiny int matrix: a real cut
    if page_bytes != 4096:
        tables = checkpoint_tables(ck, nodes, page=page_bytes, fmt=fmt, group=8)
    for kind, (rows, cols) in shapes.items():
        table = tables[1][kind]
        owner = _owner_by_table(table)
        np.testing.assert_array_equal(owner, _owner_by_rule(rows, cols, BITS[fmt], page_bytes, nodes))
        if fmt != "bf16":
            scales = tables[1][f"{kind}_scales"]
            assert (scales.rows, scales.cols, scales.fmt) == (rows, cols // 8, "fp32")
            np.testing.assert_array_equal(_owner_by_table(scales),
                                          _owner_by_rule(rows, cols // 8, 32, page_bytes, nodes))
        else:
            assert f"{kind}_scales" not in tables[1]


@pytest.mark.parametrize("nodes", [(0, 1), (0, 1, 2)])
def test_mxfp4_tables_have_group_32_and_one_byte_scales(tmp_path, rng, nodes):
    H, I, E = 96, 64, 3  # value rows of 48/32 bytes, scale rows of 3/2 bytes: pages cut rows
    directory = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, E, int(rng.integers(1 << 31)),
                                hidden_size=H, intermediate_size=I, progress=False)
    tables = checkpoint_tables(open_checkpoint(directory), nodes, page=64, fmt="mxfp4")[0]
    for kind, (rows, cols) in {"gate": (E * I, H), "up": (E * I, H), "down": (E * H, I)}.items():
        assert (tables[kind].cols, tables[kind].fmt) == (cols, "mxfp4")
        np.testing.assert_array_equal(_owner_by_table(tables[kind]), _owner_by_rule(rows, cols, 4, 64, nodes))
        scales = tables[f"{kind}_scales"]
        assert (scales.rows, scales.cols, scales.fmt) == (rows, cols // 32, "e8m0")
        np.testing.assert_array_equal(_owner_by_table(scales), _owner_by_rule(rows, cols // 32, 8, 64, nodes))
    with pytest.raises(ValueError, match="weight_format 'mxfp4' takes group 32 only"):
        checkpoint_tables(open_checkpoint(directory), nodes, page=64, fmt="mxfp4", group=64)


def test_tables_from_checkpoint_equal_tables_from_shapes_real_models(tmp_path):
    """A real-shape Qwen3-30B-A3B checkpoint: tables from its headers equal tables from the
    model's published shapes (numa_moe.checkpoints.synthetic.MODEL_SPECS), and the paper's periods
    hold at 2 nodes."""
    directory = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, 2, 0, progress=False)
    tables = checkpoint_tables(open_checkpoint(directory), 2, "4k", "bf16")[0]
    assert tables["gate"] == SegmentTable.theoretical(2 * 768, 2048, "bf16", 4096, 2)
    assert tables["down"] == SegmentTable.theoretical(2 * 2048, 768, "bf16", 4096, 2)
    assert tables["gate"].period_rows == 2 and tables["down"].period_rows == 16


def _run(args):
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    return result


def test_cli_make_checkpoint_tables_inspect(tmp_path):
    out = tmp_path / "q235"
    result = _run(["make-checkpoint", "--like", "qwen3-235b", "--layers", "1", "--experts", "2",
                   "--quiet", "--shard-mb", "30", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 experts, H=4096, I=1536, top-k=2" in result.output
    assert (out / "model.safetensors.index.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["num_experts"] == 2 and config["moe_intermediate_size"] == 1536

    tables_path = tmp_path / "sub" / "tables.json"
    result = _run(["tables", str(out), "--nodes", "2", "--page", "4k", "--format", "int8",
                   "--group", "128", "-o", str(tables_path), "--quiet"])
    assert result.exit_code == 0, result.output
    document = json.loads(tables_path.read_text())
    assert document["nodes"] == [0, 1] and document["format"] == "int8" and document["group"] == 128
    down = SegmentTable.from_dict(document["layers"]["0"]["down"])
    assert down == SegmentTable.theoretical(2 * 4096, 1536, "int8", 4096, 2)
    assert SegmentTable.from_dict(document["layers"]["0"]["down_scales"]).cols == 1536 // 128
    lines = [l for l in result.output.splitlines() if l.strip().startswith("0  down ")]
    assert lines and "[8192, 1536]" in lines[0] and "1.000" in lines[0]
    assert not list(tmp_path.glob("sub/.*.tmp"))  # the temporary file was renamed

    result = _run(["inspect", str(out), "--tensor", "*.experts.1.down_proj.*", "--nodes", "2", "--touch", "all",
                   "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    (tensor,) = report["tensors"]
    assert tensor["name"] == "model.layers.0.mlp.experts.1.down_proj.weight"
    assert tensor["pages_not_present"] == 0 and tensor["remote_fraction_table"] == 0


def test_cli_errors_are_messages(tmp_path):
    result = CliRunner().invoke(cli, ["tables", str(tmp_path), "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 1 and "no *.safetensors files" in result.output
    result = CliRunner().invoke(cli, ["tables", str(tmp_path), "--pattern", "x", "-o", "t.json"])
    assert result.exit_code == 2 and "--pattern needs --kinds" in result.output
    result = CliRunner().invoke(cli, ["make-checkpoint", "--like", "mixtral-8x7b", "--experts", "9",
                                      "-o", str(tmp_path / "x"), "--quiet"])
    assert result.exit_code == 1 and "experts must be in 1..8" in result.output


def test_cli_bad_nodes_and_layers_are_messages(tmp_path):
    ckpt = tmp_path / "ck"
    make_checkpoint(ckpt, "qwen3-30b-a3b", layers=1, experts=2, progress=False)
    for nodes in ("abc", "", "0", "-1", "0,x"):
        result = CliRunner().invoke(cli, ["tables", str(ckpt), "--nodes", nodes, "-o", str(tmp_path / "t.json")])
        assert isinstance(result.exception, SystemExit) and result.exit_code in (1, 2), (nodes, result.output)
        assert "nodes" in result.output, result.output
    result = CliRunner().invoke(cli, ["tables", str(ckpt), "--layers", "x", "-o", str(tmp_path / "t.json")])
    assert isinstance(result.exception, SystemExit) and "--layers" in result.output, result.output
    result = CliRunner().invoke(cli, ["inspect", str(ckpt), "--nodes", "abc"])
    assert isinstance(result.exception, SystemExit) and "count N or a list" in result.output, result.output


def test_cli_inspect_plot_and_pages_misuse_are_messages(tmp_path):
    ckpt = tmp_path / "ck"
    make_checkpoint(ckpt, "qwen3-30b-a3b", layers=1, experts=2, progress=False)
    result = CliRunner().invoke(cli, ["inspect", str(ckpt), "--plot", str(tmp_path / "missing" / "p.png")])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
    assert "p.png" in result.output
    result = CliRunner().invoke(cli, ["inspect", str(ckpt), "--pages"])
    assert result.exit_code == 2 and "--pages" in result.output and "--json" in result.output


def test_cli_tables_scale_dtype_names_the_scales_dtype(tmp_path, rng):
    """`tables --scale-dtype` (the name every other command uses; `--scale-format` is read
    as well) sets the dtype of the scale tables: their columns lie on the nodes the
    interleave rule puts each scale element's bytes on."""
    out = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, 2, 0, progress=False)
    group = int(rng.choice([32, 64, 128]))
    scale_dtype = str(rng.choice(["fp16", "bf16", "fp32"]))
    documents = []
    for option in ("--scale-dtype", "--scale-format"):
        path = tmp_path / f"{option}.json"
        result = _run(["tables", str(out), "--nodes", "2", "--page", "4k", "--format", "int4", "--group",
                       str(group), option, scale_dtype, "-o", str(path), "--quiet"])
        assert result.exit_code == 0, result.output
        documents.append(json.loads(path.read_text()))
    assert documents[0] == documents[1]
    assert documents[0]["scale_format"] == scale_dtype
    scales = SegmentTable.from_dict(documents[0]["layers"]["0"]["down_scales"])
    rows, cols = 2 * 2048, 768 // group
    bits = {"fp16": 16, "bf16": 16, "fp32": 32}[scale_dtype]
    np.testing.assert_array_equal(_owner_by_table(scales), _owner_by_rule(rows, cols, bits, 4096, (0, 1)))
