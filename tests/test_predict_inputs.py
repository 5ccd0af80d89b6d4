"""``proteus predict``'s inputs: every check that needs no model runs before torch, the knowledge base's
objects or a backbone load (a missing knowledge base, a run folder given for its ``kb/``, an unreadable
manifest, each image's header: refused in well under a second of CPU); folders (recursively, images by
content), globs and ``-`` (paths on standard input); rows written as JSON Lines or CSV; a summary. The
end-to-end test predicts a folder of 1,000 generated images with the tiny knowledge base of conftest's
``world``."""

from __future__ import annotations

import csv
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tiny import write_image

#: CPU seconds (user + system, the whole process: interpreter, imports, the check) a refusal may take
CPU_BUDGET = 1.0


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares ``width`` x ``height`` (nothing decodable behind it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
    return path


def _fake_kb(root: Path) -> Path:
    """A folder whose manifest passes the checks made before loading (nothing behind it loads)."""
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"format": "proteus-kb", "format_version": 5}))
    return root


def _refusal(argv: list[str]) -> tuple[int, str, float, bool]:
    """(exit code, stderr, CPU seconds of the process, whether it imported torch) of ``proteus`` ``argv`` in
    a fresh interpreter; the CPU time is the process's own (``wait4``'s resource usage: user + system)."""
    code = (
        "import sys\nfrom proteus.cli import main\n"
        f"rc = main({argv!r})\nprint('torch' in sys.modules)\nsys.exit(rc)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _, status, usage = os.wait4(p.pid, 0)  # (its few lines fit in the pipes)
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.stdout is not None and p.stderr is not None
    out, err = p.stdout.read(), p.stderr.read()
    p.stdout.close()
    p.stderr.close()
    return p.returncode, err, usage.ru_utime + usage.ru_stime, out.strip() == "True"


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    write_image(root / "photo.jpg", 1, (64, 64))
    data = (root / "photo.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (root / "empty.jpg").write_bytes(b"")
    (root / "notes.jpg").write_text("a shopping list, not a photo\n")
    _png_header(root / "huge_72mp.png", 9000, 8000)
    run = root / "runs" / "quickstart"
    _fake_kb(run / "kb")
    _fake_kb(root / "kb")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "manifest.json").write_text('{"format": "proteus-kb", ')
    return root


PHOTO = "{root}/photo.jpg"
CASES = {
    "kb folder missing": (["--kb", "{root}/nope", PHOTO], "nope: no knowledge base here (no such directory)"),
    "a run folder for its kb": (
        ["--kb", "{root}/runs/quickstart", PHOTO],
        "quickstart: no knowledge base here (missing manifest.json); did you mean {root}/runs/quickstart/kb?",
    ),
    "manifest unreadable": (["--kb", "{root}/corrupt", PHOTO], "manifest.json: corrupt manifest"),
    "truncated jpeg": (
        ["--kb", "{root}/kb", "{root}/truncated.jpg"],
        "truncated.jpg: cannot decode the image, the file is truncated",
    ),
    "empty file": (["--kb", "{root}/kb", "{root}/empty.jpg"], "empty.jpg: an empty file"),
    "text named .jpg": (
        ["--kb", "{root}/kb", "{root}/notes.jpg"], "notes.jpg: not an image in a format PIL can read"
    ),
    "72 megapixels": (
        ["--kb", "{root}/kb", "{root}/huge_72mp.png"], "9000 x 8000 = 72.0 megapixels is above the limit"
    ),
    "missing image": (["--kb", "{root}/kb", "{root}/nothere.jpg"], "nothere.jpg: no such file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_model_in_under_a_second_of_cpu(bad: Path, case: str) -> None:
    """Each refusal: exit 2, the one line naming the folder or file, no torch imported, and under
    :data:`CPU_BUDGET` seconds of CPU for the whole process (CPU time, not wall time: the same on a busy
    machine)."""
    args, said = CASES[case]
    rc, err, cpu, torch_loaded = _refusal(["predict", *(a.format(root=bad) for a in args)])
    assert rc == 2 and said.format(root=bad) in err and err.count("\n") == 1, err
    assert not torch_loaded, f"{case}: torch was imported before the refusal"
    assert cpu < CPU_BUDGET, f"{case}: {cpu:.2f} s of CPU before the refusal"


def test_every_command_reading_a_kb_names_the_folder_before_loading(bad: Path) -> None:
    """The commands that read a knowledge base check its folder first: the same message, no torch."""
    for argv in (["kb", "info", f"{bad}/runs/quickstart"], ["evaluate", "--kb", f"{bad}/nope"],
                 ["serve", "--kb", f"{bad}/runs/quickstart"], ["kb", "gc", f"{bad}/nope"]):  # fmt: skip
        rc, err, _, torch_loaded = _refusal(argv)
        assert rc == 2 and "no knowledge base here" in err and not torch_loaded, (argv, err)


# --------------------------------------------------------------------------------------------- inputs
def test_folders_globs_and_stdin(tmp_path: Path) -> None:
    from proteus.cli.inputs import image_inputs

    root = tmp_path / "photos"
    (root / "b" / "deeper").mkdir(parents=True)
    (root / ".cache").mkdir()
    write_image(root / "a.png", 1)
    write_image(root / "b" / "deeper" / "c.jpg", 2)
    (root / "b" / "no-suffix").write_bytes((root / "a.png").read_bytes())  # an image by its content
    (root / "README").write_text("holiday photos\n")  # no image: ignored
    write_image(root / ".cache" / "thumb.png", 3)  # hidden: left out
    (root / "b" / "broken.jpg").write_text("not a jpeg")  # an image's name: reported
    got = image_inputs([str(root)], max_pixels=None, skip_unreadable=True)
    assert got.files == [
        str(root / f) for f in ("a.png", "b/no-suffix", "b/deeper/c.jpg")
    ]  # a folder's files first
    assert [p for p, _ in got.skipped] == [str(root / "b" / "broken.jpg")] and got.ignored == 1
    with pytest.raises(ValueError, match="broken.jpg: not an image.*--skip-unreadable goes on without it"):
        image_inputs([str(root)], max_pixels=None)
    pattern = str(root / "**" / "*.jpg")
    got = image_inputs([pattern], max_pixels=None, skip_unreadable=True)
    assert got.files == [str(root / "b" / "deeper" / "c.jpg")] and len(got.skipped) == 1
    listed = io.StringIO(f"{root / 'a.png'}\n\n{root / 'b' / 'deeper'}\n")
    got = image_inputs(["-", str(root / "a.png")], max_pixels=None, stdin=listed)
    assert got.files == [str(root / "a.png"), str(root / "b" / "deeper" / "c.jpg"), str(root / "a.png")]
    with pytest.raises(ValueError, match=r"\*\.gif: no file matches this pattern"):
        image_inputs([str(root / "*.gif")], max_pixels=None)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "BMP"])
def test_a_truncated_file_is_found_by_its_ending(tmp_path: Path, fmt: str) -> None:
    """A file cut short is refused by the header check (its format's ending missing, then decoded); one
    with bytes after a complete image is accepted."""
    from proteus.images import ImageError, check_image_file

    whole = tmp_path / f"whole.{fmt.lower()}"
    write_image(whole, 5, (48, 40))
    data = whole.read_bytes()
    assert check_image_file(whole).format == fmt
    cut = tmp_path / f"cut.{fmt.lower()}"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ImageError, match="cut"):
        check_image_file(cut)
    padded = tmp_path / f"padded.{fmt.lower()}"
    padded.write_bytes(data + b"\0" * 300 + b"trailing bytes")
    assert (check_image_file(padded).width, check_image_file(padded).height) == (48, 40)


def test_out_takes_jsonl_or_csv() -> None:
    from proteus.cli.inputs import output_format

    assert output_format("p.csv") == "csv" and output_format("p.jsonl") == "jsonl"
    for bad, why in (("p.json", "write .jsonl"), ("nowhere/p.csv", "does not exist"), (".", "write .jsonl")):
        with pytest.raises(ValueError, match=why):
            output_format(bad)


# ----------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_a_folder_of_a_thousand_images(
    world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``proteus predict --kb KB FOLDER --out FILE.csv``: 1,000 generated images in nested folders (and a
    README, and a truncated JPEG skipped with --skip-unreadable) predicted in batches with a progress line;
    one CSV row each; a summary of the counts per class."""
    import proteus.progress
    from proteus.cli import main

    monkeypatch.setattr(proteus.progress, "PLAIN_MIN_GAP", 0.0)  # a progress line however fast it goes
    root = tmp_path / "photos"
    for i in range(1000):
        folder = root / f"set{i % 4}" / f"day{i % 7}"
        folder.mkdir(parents=True, exist_ok=True)
        write_image(folder / f"{i:04d}.png", i, (16, 16))
    (root / "README.txt").write_text("1,000 photos\n")
    write_image(root / "bad.jpg", 0, (32, 32))
    (root / "bad.jpg").write_bytes((root / "bad.jpg").read_bytes()[:200])
    out = tmp_path / "predictions.csv"
    capsys.readouterr()
    argv = [
        "predict",
        "--kb",
        str(world["kb1"]),
        str(root),
        "--out",
        str(out),
        "--skip-unreadable",
        "--top-k",
        "2",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    rows = list(csv.DictReader(out.open()))
    predicted = [r for r in rows if not r["error"]]
    assert len(predicted) == 1000 and [r["file"] for r in rows if r["error"]] == [str(root / "bad.jpg")]
    assert {r["nearest_class"] for r in predicted} <= {"a", "b"} and all(r["top2_class"] for r in predicted)
    assert "predict: " in err and "1000/1000 (100%)" in err, err  # the progress line
    summary = [line for line in err.splitlines() if line.startswith("predicted 1000 images in ")]
    assert len(summary) == 1, err
    counts = {c: sum(r["class"] == c for r in predicted) for c in "ab"}
    unknown = sum(r["known"] == "false" for r in predicted)
    for c, k in counts.items():
        assert not k or f"{c} {k}" in summary[0], summary
    assert sum(counts.values()) + unknown == 1000
    assert "1 unreadable (skipped)" in summary[0] and "1 other file in the folders ignored" in summary[0]


@pytest.mark.slow
def test_paths_on_stdin_to_json_lines(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from proteus.cli import main

    files = [world["tree"] / "test" / c / "0.png" for c in "ab"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{f}\n" for f in files)))
    out = tmp_path / "p.jsonl"
    assert main(["predict", "--kb", str(world["kb1"]), "-", "--out", str(out), "-q"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["file"] for r in rows] == [str(f) for f in files] and all("confidence" in r for r in rows)


@pytest.mark.slow
def test_the_json_table_of_the_docs_names_every_key_of_a_row(
    world: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/predict.md's table of the JSON row lists exactly the keys a row has."""
    import re

    from proteus.cli import main

    image = world["tree"] / "test" / "a" / "0.png"
    capsys.readouterr()
    assert main(["predict", "--kb", str(world["kb1"]), str(image), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    page = (Path(__file__).resolve().parents[1] / "docs" / "predict.md").read_text()
    section = page[page.index("## The JSON row") :].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert documented == set(row), (
        f"documented only: {documented - set(row)}; undocumented: {set(row) - documented}"
    )
