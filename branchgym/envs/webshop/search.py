"""WebShop's search engine: Lucene's BM25 over upstream's document text.

Upstream indexes one document per product with pyserini 0.17.0 (its requirements pin;
Anserini 0.14.3 on Lucene 8.11):
the lowercased ``title + description + first bullet point + option text``
(``search_engine/convert_product_file_format.py``), analysed by Anserini's default
English analyzer (StandardTokenizer, English possessive filter, lowercase, Lucene's 33
English stop words, Porter stemmer), ranked by Lucene's ``BM25Similarity`` with
k1 = 0.9, b = 0.4, and a query returns the top 50 hits. Anserini's bag-of-words query
is one SHOULD clause per distinct term, boosted by its count in the query.

This module reproduces Lucene's arithmetic, not just the formula:

* **Tokens** follow StandardTokenizer's UAX #29 word rules for the scripts in the data:
  letters and digits join (``64gb``); ``.``, ``'`` and ``\u2019`` join letters
  (``u.s.a``, ``l'eau``) and digits (``6.76``); ``:`` and ``\u00b7`` join letters;
  ``,`` and ``;`` join digits (``$1,299.99`` -> ``1,299.99``; ``$`` is dropped);
  hyphens and other punctuation split (``t-shirt`` -> ``t``, ``shirt``); Han and
  Hiragana characters are one token each; tokens over 255 characters are cut.
* **Document length** is stored as Lucene's one-byte norm (``SmallFloat.intToByte4``:
  exact below 24 tokens, then 4 significant bits, rounded down) and decoded with
  ``byte4ToInt``; the average length is exact (``sumTotalTermFreq / docCount``).
* **Scores** are float32 as in Lucene 8.4+'s ``BM25Similarity`` (no ``k1 + 1``
  factor): ``idf = (float) log(1 + (N - df + 0.5) / (df + 0.5))``, ``weight = boost *
  idf``, ``cache[norm] = 1 / (k1 * ((1 - b) + b * len[norm] / avgdl))``, term score
  ``weight - weight / (1 + tf * cache[norm])``, clauses summed in double and cast to
  float; ties by document id (catalog order).

PyStemmer's ``porter`` (Snowball's rendering of Porter's algorithm) stands in for
Lucene's ``PorterStemmer``; they agree on ordinary English words. The index (an
inverted file in numpy arrays) is built once per catalog and cached on disk under the
branchgym cache folder, keyed by a hash of every document's text and the analyzer.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from branchgym.envs.webshop.paths import cache_dir
from branchgym.error import DependencyMissingError

__all__ = [
    "SEARCH_RETURN_N",
    "LUCENE_STOPWORDS",
    "K1",
    "B",
    "analyze",
    "tokenize",
    "document_text",
    "int_to_byte4",
    "byte4_to_int",
    "HasProducts",
    "SearchIndex",
]

#: Hits per search, as upstream.
SEARCH_RETURN_N = 50
#: Anserini's BM25 parameters (pyserini's defaults, used by upstream).
K1, B = 0.9, 0.4
#: Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET``.
LUCENE_STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their "
    "then there these they this to was will with".split()
)
_ANALYZER_VERSION = 2
_MAX_TOKEN = 255  # StandardTokenizer's default maxTokenLength
# UAX #29 word segmentation for the scripts in product data (see the module docstring):
# MidLetter/MidNumLet between letters, MidNum/MidNumLet between digits.
_WORD = re.compile(
    r"\w+(?:(?:(?<=[^\W\d_])[.'\u2018\u2019:\u00b7](?=[^\W\d_])"
    r"|(?<=\d)[.'\u2018\u2019,;](?=\d))\w+)*"
)
_CJK = re.compile("([\u3040-\u309f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff])")


def _stemmer() -> Any:
    try:
        import Stemmer
    except ImportError as exc:  # pragma: no cover - the extra installs it
        raise DependencyMissingError.for_extra("WebShop search", "webshop", "PyStemmer") from exc
    return Stemmer.Stemmer("porter")


_STEMMER: Any = None


def tokenize(text: str) -> list[str]:
    """StandardTokenizer's tokens of ``text``, lowercased (before stop words and stems)."""
    text = text.lower()
    if _CJK.search(text):
        text = _CJK.sub(r" \1 ", text)
    out = []
    for t in _WORD.findall(text):
        if not t.strip("_"):
            continue
        if len(t) > _MAX_TOKEN:
            out.extend(t[i : i + _MAX_TOKEN] for i in range(0, len(t), _MAX_TOKEN))
        else:
            out.append(t)
    return out


def analyze(text: str) -> list[str]:
    """Tokens of ``text`` as the index sees them (tokenize, possessives, stop words, stem)."""
    global _STEMMER
    if _STEMMER is None:
        _STEMMER = _stemmer()
    toks = []
    for t in tokenize(text):
        if t.endswith(("'s", "\u2019s", "\u2018s")):
            t = t[:-2]
        if t and t not in LUCENE_STOPWORDS:
            toks.append(t)
    return _STEMMER.stemWords(toks)


def _long_to_int4(i: int) -> int:
    bits = i.bit_length()
    if bits < 4:
        return i
    shift = bits - 4
    return ((i >> shift) & 0x07) | ((shift + 1) << 3)


def _int4_to_long(i: int) -> int:
    bits, shift = i & 0x07, (i >> 3) - 1
    return bits if shift == -1 else (bits | 0x08) << shift


_FREE = 255 - _long_to_int4(2**31 - 1)  # 24: lengths below it are stored exactly


def int_to_byte4(n: int) -> int:
    """Lucene's ``SmallFloat.intToByte4``: a document length as its norm byte (0-255)."""
    return n if n < _FREE else _FREE + _long_to_int4(n - _FREE)


def byte4_to_int(b: int) -> int:
    """Lucene's ``SmallFloat.byte4ToInt``: the length a norm byte stands for."""
    return b if b < _FREE else _FREE + _int4_to_long(b - _FREE)


_LENGTH_TABLE = np.array([byte4_to_int(b) for b in range(256)], dtype=np.float32)


def document_text(product: dict[str, Any]) -> str:
    """Upstream's indexed text of one product (lowercased)."""
    option_text = ", and ".join(
        f"{name}: {', '.join(values)}" for name, values in product.get("options", {}).items()
    )
    bullets = product.get("BulletPoints") or [""]
    return " ".join(
        [product["Title"], product["Description"], bullets[0] if bullets else "", option_text]
    ).lower()


class HasProducts(Protocol):
    """What the index reads of a :class:`~branchgym.envs.webshop.data.Catalog`.

    The catalog builds its index from this module, so the index names the one attribute it
    uses instead of importing the class.
    """

    @property
    def products(self) -> Sequence[dict[str, Any]]:
        """Upstream's product records, in catalog order (the index's document ids)."""


class SearchIndex:
    """An inverted index over a catalog's products scored as Lucene; immutable once built.

    Attributes:
        n_docs: Number of documents (products).
        vocab: Analysed term -> term id.
        indptr, docs, tfs: Postings in CSR form: term ``t``'s documents are
            ``docs[indptr[t]:indptr[t+1]]`` with term frequencies ``tfs[...]``.
        norms: Each document's one-byte length norm (``int_to_byte4(length)``).
        lengths: Each document's exact length in tokens (for references and tests).
        avgdl: Lucene's average field length (float32).
    """

    def __init__(
        self,
        vocab: dict[str, int],
        indptr: np.ndarray,
        docs: np.ndarray,
        tfs: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Wrap built or loaded postings; derives norms, avgdl and the norm cache."""
        self.vocab = vocab
        self.indptr, self.docs, self.tfs = indptr, docs, tfs
        self.lengths = lengths
        self.n_docs = int(lengths.size)
        self.norms = np.array([int_to_byte4(int(n)) for n in lengths], dtype=np.uint8)
        n = max(self.n_docs, 1)
        self.avgdl = np.float32(float(lengths.sum()) / n)
        k1, b = np.float32(K1), np.float32(B)
        # Java float arithmetic, operation by operation
        cache = np.float32(1) / (
            k1 * ((np.float32(1) - b) + b * _LENGTH_TABLE / self.avgdl).astype(np.float32)
        )
        self._norm_inverse = cache.astype(np.float32)
        # per posting, Lucene's ``1f + freq * normInverse`` (float32), computed once
        self._denom = np.float32(1) + tfs.astype(np.float32) * self._norm_inverse[self.norms[docs]]
        df = np.diff(indptr).astype(np.float64)
        self.idf = np.log(1.0 + (n - df + 0.5) / (df + 0.5)).astype(np.float32)

    @classmethod
    def build(cls, texts: Sequence[str], *, progress: bool = False) -> SearchIndex:
        """Analyse ``texts`` (one per document, in document-id order) and index them."""
        vocab: dict[str, int] = {}
        rows: list[list[tuple[int, int]]] = []
        lengths = np.zeros(len(texts), dtype=np.int64)
        it: Any = texts
        if progress:
            from tqdm import tqdm

            it = tqdm(texts, desc="webshop: analysing documents", unit="doc")
        for d, text in enumerate(it):
            toks = analyze(text)
            lengths[d] = len(toks)
            rows.append([(vocab.setdefault(t, len(vocab)), c) for t, c in Counter(toks).items()])
        n_post = sum(len(r) for r in rows)
        term = np.empty(n_post, dtype=np.int64)
        doc = np.empty(n_post, dtype=np.int32)
        tf = np.empty(n_post, dtype=np.float32)
        i = 0
        for d, r in enumerate(rows):
            for t, c in r:
                term[i], doc[i], tf[i] = t, d, c
                i += 1
        order = np.lexsort((doc, term))  # by term, then document
        indptr = np.zeros(len(vocab) + 1, dtype=np.int64)
        np.add.at(indptr, term + 1, 1)
        return cls(vocab, np.cumsum(indptr), doc[order], tf[order], lengths)

    @classmethod
    def for_catalog(cls, catalog: HasProducts, *, progress: bool | None = None) -> SearchIndex:
        """Load the catalog's index from the disk cache, or build and cache it."""
        texts = [document_text(p) for p in catalog.products]
        h = hashlib.blake2b(digest_size=12)
        h.update(f"analyzer{_ANALYZER_VERSION}|lucene-postings|".encode())
        for t in texts:
            h.update(t.encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
        path = cache_dir() / "webshop" / f"index-v{_ANALYZER_VERSION}-{h.hexdigest()}.npz"
        show = len(texts) >= 20_000 if progress is None else progress
        if path.is_file():
            try:
                return cls.load(path)
            except Exception:  # a damaged cache is rebuilt, not trusted
                path.unlink(missing_ok=True)
        idx = cls.build(texts, progress=show)
        idx.save(path)
        return idx

    def save(self, path: os.PathLike | str) -> None:
        """Write the index to ``path`` (an ``.npz``); a failure leaves no partial file."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}.npz"
        terms = np.array(sorted(self.vocab, key=self.vocab.__getitem__), dtype=object)
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            np.savez(
                tmp,
                terms=terms.astype(str),
                indptr=self.indptr,
                docs=self.docs,
                tfs=self.tfs,
                lengths=self.lengths,
            )
            os.replace(tmp, path)
        except OSError:  # read-only cache or a concurrent writer: keep the in-memory index
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: os.PathLike | str) -> SearchIndex:
        """Read an index written by :meth:`save`."""
        with np.load(os.fspath(path), allow_pickle=False) as z:
            terms = z["terms"].tolist()
            return cls(
                {t: i for i, t in enumerate(terms)},
                z["indptr"],
                z["docs"],
                z["tfs"],
                z["lengths"],
            )

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> tuple[int, ...]:
        """Positions of the top ``k`` products for ``query``, best first, ties by position.

        Only products sharing at least one analysed term with the query are returned, as
        a Lucene boolean query of SHOULD clauses would.
        """
        scores = self._score(query)
        hits = np.flatnonzero(scores > 0)  # a matched document always scores > 0
        if hits.size > k:
            s = scores[hits]
            kth = np.partition(s, hits.size - k)[hits.size - k]
            hits = hits[s >= kth]  # every doc tied with the k-th stays a candidate
        order = np.lexsort((hits, -scores[hits]))
        return tuple(int(i) for i in hits[order][:k])

    def scores(self, query: str) -> np.ndarray:
        """Lucene's BM25 score (float32) of every product for ``query``; 0 if unmatched."""
        return self._score(query)

    def _score(self, query: str) -> np.ndarray:
        counts = Counter(t for t in analyze(query) if t in self.vocab)
        acc = np.zeros(self.n_docs, dtype=np.float64)
        for term, boost in counts.items():
            t = self.vocab[term]
            lo, hi = self.indptr[t], self.indptr[t + 1]
            weight = np.float32(boost) * self.idf[t]
            acc[self.docs[lo:hi]] += weight - weight / self._denom[lo:hi]  # float32 scores
        return acc.astype(np.float32)
