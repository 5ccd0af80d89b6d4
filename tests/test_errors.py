"""The error taxonomy (issue 24): every error proteus raises on purpose is a ``ProteusError`` that keeps its
built-in base, and the command line maps exactly those to exit code 2; anything else is an internal error
(exit code 1, one line asking for a report), and ``--debug`` shows the traceback."""

from __future__ import annotations

import pytest

import proteus.cli.parser
from proteus.backbones.weights import WeightsError, WeightsNotFoundError
from proteus.cli import main
from proteus.cli.commands import UsageError
from proteus.config import ConfigError, parse_set
from proteus.distributed import DeviceError
from proteus.engine.errors import TaskError
from proteus.errors import NotFittedError, ProteusError
from proteus.images import ImageError, ImageTooLargeError
from proteus.kb import KBError
from proteus.registry import Registry, UnknownNameError
from proteus.signatures.errors import SignatureFitError
from proteus.streams.errors import BenchmarkError, CorruptImageError, DataNotFoundError, TaskSpecError

#: each error class and the built-in bases it has always had (``except ValueError`` keeps catching it)
BUILTIN_BASES = {
    WeightsError: (ValueError, RuntimeError),
    WeightsNotFoundError: (FileNotFoundError,),
    ConfigError: (ValueError,),
    KBError: (RuntimeError,),
    TaskError: (ValueError,),
    ImageError: (ValueError,),
    ImageTooLargeError: (ValueError,),
    UsageError: (ValueError,),
    SignatureFitError: (ValueError,),
    DeviceError: (ValueError,),
    BenchmarkError: (ValueError,),
    TaskSpecError: (ValueError,),
    DataNotFoundError: (FileNotFoundError,),
    CorruptImageError: (OSError, ImageError),
    UnknownNameError: (KeyError,),
    NotFittedError: (ValueError, AttributeError),
}


@pytest.mark.parametrize("cls", list(BUILTIN_BASES), ids=lambda c: c.__name__)
def test_every_error_is_a_proteus_error_and_keeps_its_builtin_base(cls: type) -> None:
    assert issubclass(cls, ProteusError)
    assert all(issubclass(cls, base) for base in BUILTIN_BASES[cls])


def test_unknown_name_reads_as_its_message() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("a")(1)
    with pytest.raises(KeyError) as e:
        reg.get("b")
    assert str(e.value) == "unknown widget 'b'; choose one of: a"  # not KeyError's quoted repr


def test_set_values_that_are_not_yaml_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"--set train.lr: not a valid YAML value: '\[1'"):
        parse_set(["train.lr=[1"])
    with pytest.raises(
        ConfigError, match=r"train is a section, not a value: set train.<key>=\.\.\.; keys: ep"
    ):
        parse_set(["train=1", "train.lr=2"])


def _command_raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def boom(args: object) -> int:
        raise exc

    monkeypatch.setattr(proteus.cli.parser, "cmd_list", boom)


def test_a_proteus_error_is_bad_input(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _command_raising(monkeypatch, ConfigError("train.lr: expected a number, got 'abc'"))
    assert main(["list"]) == 2
    assert capsys.readouterr().err == "error: train.lr: expected a number, got 'abc'\n"


@pytest.mark.parametrize("exc", [KeyError("head"), ValueError("bad\nshape"), OSError(5, "I/O error")])
def test_any_other_exception_is_an_internal_error(monkeypatch: pytest.MonkeyPatch, capsys, exc) -> None:
    _command_raising(monkeypatch, exc)
    assert main(["list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"internal error: {type(exc).__name__}: ") and err.count("\n") == 1
    assert "this is a bug in proteus; please report it (run with --debug for the traceback)" in err


def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    _command_raising(monkeypatch, KeyError("head"))
    with pytest.raises(KeyError):
        main(["--debug", "list"])
    _command_raising(monkeypatch, ConfigError("x"))
    with pytest.raises(ConfigError):
        main(["--debug", "list"])


def test_ctrl_c_is_130(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _command_raising(monkeypatch, KeyboardInterrupt())
    assert main(["list"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_registry_entry_answers_its_traits_then_its_attributes() -> None:
    class Kind:
        one_space = True

    reg: Registry[object] = Registry("test.traits")
    reg.register("a", help="an entry", reads_rank=True)(Kind())
    reg.register("b")(Kind())
    assert reg.trait("a", "reads_rank") is True and reg.trait("b", "reads_rank") is None
    assert reg.trait("b", "one_space") is True  # the entry's own attribute
    reg.unregister("a")
    reg.register("a")(object())
    assert reg.trait("a", "reads_rank") is None  # an entry registered again keeps no old trait
    with pytest.raises(UnknownNameError, match="unknown test.traits 'c'"):
        reg.trait("c", "reads_rank")


def test_a_registry_refuses_an_unhashable_name_by_name() -> None:
    """A hand-edited file may hold a list where a strategy name belongs (found by tests/test_fuzz.py)."""
    from proteus.heads import PROTOTYPES
    from proteus.registry import UnknownNameError

    assert [] not in PROTOTYPES
    with pytest.raises(UnknownNameError, match="unknown"):
        PROTOTYPES.get([])  # type: ignore[arg-type]
