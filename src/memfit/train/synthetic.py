"""A small multilingual toxic-comment CSV with a learnable rule, for tests and demos (no download).

Note 1 (the rule). Jigsaw's multilingual competition labelled comments in English, Spanish,
French, Italian, Portuguese, Russian and Turkish as ``toxic`` (0/1). Here each comment is a few
neutral words of one language; a toxic comment also carries one insult word of that language
(``_INSULTS``). The label is 1 exactly when an insult is present, flipped for a ``noise``
fraction of rows, so a classifier that learns the words reaches an AUC near ``1 - noise`` and one
that learns nothing stays at 0.5. The rows are a pure function of ``seed``.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

__all__ = ["make_toxic_csv", "LANGUAGES"]

_NEUTRAL = {
    "en": "the a good day article page edit source thanks please talk history people think".split(),
    "es": "el la buen día artículo página fuente gracias por favor historia gente creo".split(),
    "fr": "le la bonne journée article page source merci s'il vous plaît histoire gens".split(),
    "it": "il la buona giornata articolo pagina fonte grazie per favore storia gente".split(),
    "pt": "o a bom dia artigo página fonte obrigado por favor história pessoas acho".split(),
    "ru": "статья страница источник спасибо пожалуйста история люди думаю день хорошо".split(),
    "tr": "makale sayfa kaynak teşekkürler lütfen tarih insanlar bence gün iyi güzel".split(),
}
_INSULTS = {
    "en": ["idiot", "stupid", "moron"], "es": ["idiota", "estúpido", "imbécil"],
    "fr": ["idiot", "stupide", "crétin"], "it": ["idiota", "stupido", "cretino"],
    "pt": ["idiota", "estúpido", "imbecil"], "ru": ["идиот", "дурак", "тупой"],
    "tr": ["aptal", "salak", "gerizekalı"],
}
LANGUAGES = tuple(_NEUTRAL)


def make_toxic_csv(path, rows: int = 1000, *, seed: int = 0, toxic_fraction: float = 0.4,
                   noise: float = 0.02, max_words: int = 16) -> Path:
    """Write ``rows`` comments to ``path`` with columns ``id, comment_text, lang, toxic`` (Note 1).

    Lengths vary from 3 to ``max_words`` words, so length-grouped batches differ in length."""
    if rows < 1:
        raise ValueError(f"rows={rows}: write at least one row")
    if not 0 <= noise < 0.5 or not 0 < toxic_fraction < 1:
        raise ValueError("noise must be in [0, 0.5) and toxic_fraction in (0, 1)")
    rng = random.Random(seed)
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "comment_text", "lang", "toxic"])
        for i in range(rows):
            lang = rng.choice(LANGUAGES)
            words = rng.choices(_NEUTRAL[lang], k=rng.randint(3, max_words))
            toxic = rng.random() < toxic_fraction
            if toxic:
                words.insert(rng.randrange(len(words) + 1), rng.choice(_INSULTS[lang]))
            label = int(toxic) ^ int(rng.random() < noise)
            w.writerow([f"{i:06d}", " ".join(words), lang, label])
    return path
