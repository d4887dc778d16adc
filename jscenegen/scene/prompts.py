"""Prompt templates of the role protocol: versioned text files a user can replace.

Templates are `string.Template` files (`$name` placeholders, so JSON braces need no escaping) in
jscenegen/scene/prompts/ or in `scene.prompts_dir`. Their SHA-256 enters the protocol hash.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from string import Template

PROMPTS_VERSION = "scenegen.prompts/1"
TEMPLATE_NAMES = (
    "system", "first_user", "planner", "designer", "designer_result", "critic", "judge_system", "judge_user",
)


class PromptError(ValueError):
    """A missing template file or a placeholder the runtime does not provide."""


@dataclass(frozen=True)
class PromptTemplates:
    """The loaded template texts by name (see TEMPLATE_NAMES) and where they came from."""

    texts: dict[str, str]
    source: str

    def render(self, name: str, **values) -> str:
        """Fill template `name`. Raises PromptError naming the file and the unknown placeholder."""
        try:
            return Template(self.texts[name]).substitute(values).strip("\n")
        except KeyError as err:
            raise PromptError(f"{self.source}/{name}.txt: placeholder ${err.args[0]} is not provided") from None
        except ValueError as err:
            raise PromptError(f"{self.source}/{name}.txt: {err}") from None

    def digest(self) -> str:
        """SHA-256 over the version and every template's name and text."""
        h = hashlib.sha256(PROMPTS_VERSION.encode())
        for name in TEMPLATE_NAMES:
            h.update(f"\0{name}\0".encode())
            h.update(self.texts[name].encode())
        return h.hexdigest()


def load_templates(prompts_dir: str | None = None) -> PromptTemplates:
    """Packaged templates, or those in `prompts_dir` (every name in TEMPLATE_NAMES must exist)."""
    texts = {}
    if prompts_dir is None:
        root = resources.files("jscenegen.scene").joinpath("prompts")
        source = "jscenegen/scene/prompts"
        for name in TEMPLATE_NAMES:
            texts[name] = root.joinpath(f"{name}.txt").read_text(encoding="utf-8")
    else:
        from jscenegen.paths import resolve_data_path

        source = str(prompts_dir)
        try:
            root_dir = resolve_data_path(prompts_dir)
        except FileNotFoundError as err:
            raise PromptError(f"scene.prompts_dir: {err}") from None
        if not root_dir.is_dir():
            raise PromptError(f"scene.prompts_dir {prompts_dir}: not a directory (it holds the "
                              f"templates {', '.join(f'{n}.txt' for n in TEMPLATE_NAMES)})")
        for name in TEMPLATE_NAMES:
            p = root_dir / f"{name}.txt"
            if not p.is_file():
                raise PromptError(f"scene.prompts_dir {prompts_dir}: {p.name} is missing "
                                  f"(needed: {', '.join(TEMPLATE_NAMES)})")
            try:
                texts[name] = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise PromptError(f"scene.prompts_dir {prompts_dir}: {p.name} is not UTF-8 text "
                                  f"(byte {err.start}: {err.reason})") from None
    return PromptTemplates(texts, source)
