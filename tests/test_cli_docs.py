"""docs/cli.md's usage lines and option tables are generated from the argparse
definitions (`keras_gpufix.cli.build_parser`): the test fails when a subcommand's
`--help` and the docs disagree. `python tests/test_cli_docs.py` rewrites the block."""

import argparse
import os
import sys

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "cli.md")
BEGIN = ("<!-- generated from keras_gpufix.cli.build_parser by `python tests/test_cli_docs.py`;"
         " edit the parser, not this block -->")
END = "<!-- end of the generated block -->"


def _argument(action):
    if not action.option_strings:
        return action.metavar or "{" + ",".join(action.choices) + "}"
    takes = action.nargs != 0
    return ", ".join(f"`{o}{' ' + action.metavar if takes and action.metavar else ''}`"
                     for o in action.option_strings)


def options_markdown():
    """The usage line and the option table of every subcommand, as markdown."""
    from keras_gpufix.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = []
    for name, command in sub.choices.items():
        usage = " ".join(command.format_usage().split())
        out += [f"### {name}", "", helps[name] + ".", "", "```", usage, "```", "",
                "| argument | what it does |", "|---|---|"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            argument = _argument(action)
            if not action.option_strings:
                argument = f"`{argument}`"
            text = ((action.help or "") % {"default": action.default}).replace("|", r"\|")
            out.append(f"| {argument} | {text} |")
        out.append("")
    return "\n".join(out)


def test_every_argument_has_help_text():
    assert "|  |" not in options_markdown()


def _block(text):
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return start, end


def test_docs_cli_md_holds_every_option_of_every_subcommand():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    start, end = _block(text)
    assert text[start:end].strip() == options_markdown().strip(), (
        "docs/cli.md's options differ from `keras-gpufix COMMAND --help`: "
        "run `python tests/test_cli_docs.py` to regenerate them")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    start, end = _block(text)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text[:start] + "\n" + options_markdown() + "\n" + text[end:])
