"""WebShop's search engine: BM25 over upstream's document text, Lucene-style.

Upstream indexes one document per product with pyserini (Lucene): the lowercased
``title + description + first bullet point + option text`` (``search_engine/
convert_product_file_format.py``), analysed by Anserini's default English analyzer
(standard tokenizer, possessive filter, lowercase, Lucene's 33 English stop words,
Porter stemmer) and ranked by Lucene's BM25 with k1 = 0.9, b = 0.4; a query returns
the top 50 hits and repeated query terms weigh by their count.

This module reproduces that with ``bm25s`` (``method="lucene"``, the same idf and
term-frequency saturation) and PyStemmer's Porter stemmer. Ties are broken by catalog
order, as Lucene breaks them by document id. Known difference: Lucene stores document
lengths in a one-byte lossy encoding; bm25s uses exact lengths, which can reorder
near-ties.

The index is built once per catalog and cached on disk under the branchgym cache
folder, keyed by a hash of every document's text and the analyzer version.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from branchgym.error import DependencyMissingError

if TYPE_CHECKING:
    from branchgym.envs.webshop.data import Catalog

__all__ = [
    "SEARCH_RETURN_N",
    "LUCENE_STOPWORDS",
    "analyze",
    "document_text",
    "SearchIndex",
]

#: Hits per search, as upstream.
SEARCH_RETURN_N = 50
#: Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET``.
LUCENE_STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their "
    "then there these they this to was will with".split()
)
_ANALYZER_VERSION = 1
# Unicode word segmentation in the spirit of Lucene's StandardTokenizer: letters and
# digits, joined across inner apostrophes and dots ("l'eau", "6.76", "u.s.a").
_WORD = re.compile(r"\w+(?:[.'\u2019]\w+)*")


def _stemmer() -> Any:
    try:
        import Stemmer
    except ImportError as exc:  # pragma: no cover - the extra installs it
        raise DependencyMissingError.for_extra("WebShop search", "webshop", "PyStemmer") from exc
    return Stemmer.Stemmer("porter")


_STEMMER: Any = None


def analyze(text: str) -> list[str]:
    """Tokens of ``text`` as the index sees them (tokenize, possessives, stop words, stem)."""
    global _STEMMER
    if _STEMMER is None:
        _STEMMER = _stemmer()
    toks = []
    for t in _WORD.findall(text.lower()):
        if t.endswith(("'s", "\u2019s")):
            t = t[:-2]
        if t and t not in LUCENE_STOPWORDS:
            toks.append(t)
    return _STEMMER.stemWords(toks)


def document_text(product: dict[str, Any]) -> str:
    """Upstream's indexed text of one product (lowercased)."""
    option_text = ", and ".join(
        f"{name}: {', '.join(values)}" for name, values in product.get("options", {}).items()
    )
    bullets = product.get("BulletPoints") or [""]
    return " ".join(
        [product["Title"], product["Description"], bullets[0] if bullets else "", option_text]
    ).lower()


class SearchIndex:
    """A BM25 index over a catalog's products; immutable once built."""

    def __init__(self, retriever: Any, n_docs: int) -> None:
        """Wrap a built or loaded ``bm25s.BM25``."""
        self._bm25 = retriever
        self.n_docs = n_docs
        self._vocab: dict[str, int] = retriever.vocab_dict

    @classmethod
    def for_catalog(cls, catalog: Catalog, *, progress: bool | None = None) -> SearchIndex:
        """Load the catalog's index from the disk cache, or build and cache it."""
        bm25s = _bm25s()
        from branchgym.envs.webshop.data import cache_dir

        texts = [document_text(p) for p in catalog.products]
        h = hashlib.blake2b(digest_size=12)
        h.update(f"analyzer{_ANALYZER_VERSION}|k1=0.9|b=0.4|".encode())
        for t in texts:
            h.update(t.encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
        folder = cache_dir() / "webshop" / f"index-{h.hexdigest()}"
        show = len(texts) >= 20_000 if progress is None else progress
        if (folder / "params.index.json").is_file():
            try:
                bm = bm25s.BM25.load(str(folder), mmap=False, show_progress=False)
                return cls(bm, len(texts))
            except Exception:  # a damaged cache is rebuilt, not trusted
                shutil.rmtree(folder, ignore_errors=True)
        corpus = _tokenize_all(texts, show)
        bm = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
        bm.index(corpus, show_progress=show, leave_progress=False)
        tmp = folder.with_name(folder.name + f".tmp{id(bm)}")
        try:
            bm.save(str(tmp), show_progress=False)
            tmp.rename(folder)
        except OSError:  # read-only cache or a concurrent writer: keep the in-memory index
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(bm, len(texts))

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> tuple[int, ...]:
        """Positions of the top ``k`` products for ``query``, best first, ties by position.

        Only products sharing at least one analysed term with the query are returned, as
        a Lucene boolean query of SHOULD clauses would.
        """
        ids = [self._vocab[t] for t in analyze(query) if t in self._vocab]
        if not ids:
            return ()
        scores = np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float64)
        hits = np.flatnonzero(scores > 0)
        if hits.size > k:
            s = scores[hits]
            kth = np.partition(s, hits.size - k)[hits.size - k]
            hits = hits[s >= kth]  # every doc tied with the k-th stays a candidate
        order = np.lexsort((hits, -scores[hits]))
        return tuple(int(i) for i in hits[order][:k])

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every product for ``query`` (for inspection and tests)."""
        ids = [self._vocab[t] for t in analyze(query) if t in self._vocab]
        if not ids:
            return np.zeros(self.n_docs)
        return np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float64)


def _bm25s() -> Any:
    try:
        import bm25s
    except ImportError as exc:  # pragma: no cover - the extra installs it
        raise DependencyMissingError.for_extra("WebShop search", "webshop", "bm25s") from exc
    return bm25s


def _tokenize_all(texts: Sequence[str], progress: bool) -> list[list[str]]:
    it: Any = texts
    if progress:
        from tqdm import tqdm

        it = tqdm(texts, desc="webshop: analysing documents", unit="doc")
    return [analyze(t) for t in it]
