"""The public Python API carries type hints that resolve (typing.get_type_hints), so editors and
type checkers see the same contract docs/api.md states."""

import inspect
import typing

import pytest

import plait

# Every function the package exports, and every public method of the two communicators.
FUNCTIONS = [n for n in plait.__all__ if inspect.isfunction(getattr(plait, n))]
METHODS = [n for n, f in vars(plait.Communicator).items() if inspect.isfunction(f) and not n.startswith("_")]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_module_functions_are_typed(name):
    fn = getattr(plait, name)
    hints = typing.get_type_hints(fn)
    assert "return" in hints, name
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert all(p.name in hints for p in params), (name, hints)


@pytest.mark.parametrize("cls", [plait.Communicator, plait.HierCommunicator])
@pytest.mark.parametrize("name", METHODS)
def test_communicator_methods_are_typed(cls, name):
    fn = getattr(cls, name)
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    assert "return" in hints and all(p.name in hints for p in params), (cls.__name__, name, hints)
    assert typing.get_type_hints(plait.Handle.wait)["return"] is typing.Any
