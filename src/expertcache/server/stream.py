"""Streaming the same text as the non-streamed answer: pieces of generated text are released only
once they can no longer turn out to be the start of a stop string, and the generation's final text
settles the rest (the engine cuts a stop string, and everything after it, out of its answer)."""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could still begin one of `stops`."""
    best = 0
    for s in stops:
        for k in range(min(len(text), len(s) - 1), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopGuard:
    """Holds back the tail of the streamed text that a later piece could complete into a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._sent: list[str] = []
        self._pending = ""

    def push(self, piece: str) -> str:
        """The part of the text so far that is safe to send now ("" when all of it is held back)."""
        text = self._pending + piece
        cut = len(text) - held_back(text, self.stops)
        self._pending = text[cut:]
        if cut:
            self._sent.append(text[:cut])
        return text[:cut]

    def finish(self, final: str) -> str:
        """What remains to send so that the stream adds up to `final`, the generation's whole text."""
        sent = "".join(self._sent)
        self._pending = ""
        # What was sent never holds a possible stop's beginning, so `final` extends it; if a
        # tokenizer's full decode disagreed with its piecewise one, nothing more can be fixed here.
        return final[len(sent):] if final.startswith(sent) else ""
