"""The sidebar: conversations, newest first, filtered by a full-text search."""

from __future__ import annotations

from collections.abc import Iterable

from rich.markup import escape
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from macaron_local.store import ConversationSummary, SearchHit


class ConversationList(OptionList):
    """Lists conversations (id as option id); a search lists the conversations it matched.

    Titles and snippets are the user's own text: they are escaped before Rich sees them."""

    def show_conversations(self, rows: Iterable[ConversationSummary]) -> None:
        self.clear_options()
        for row in rows:
            title = escape((row.title or "Untitled").replace("\n", " ")[:40])
            when = row.updated_at[:16].replace("T", " ")
            self.add_option(Option(f"{title}\n[dim]{escape(row.model or '')} · {when}[/dim]", id=row.id))

    def show_hits(self, hits: Iterable[SearchHit]) -> None:
        self.clear_options()
        seen: set[str] = set()
        for hit in hits:
            if hit.conversation_id in seen:
                continue
            seen.add(hit.conversation_id)
            title = escape((hit.title or "Untitled").replace("\n", " ")[:40])
            snippet = escape(" ".join(hit.snippet.split())[:60])
            self.add_option(Option(f"{title}\n[dim]{snippet}[/dim]", id=hit.conversation_id))
        if not seen:
            self.add_option(Option("[dim]no matches[/dim]", id="__none__", disabled=True))
