"""Exact git-tree snapshots of a folder: the code the git and docker-git backends share.

A folder is snapshotted as git trees in a private object store plus a manifest of what
git does not keep. Git alone is not exact:

* a folder holding a ``.git`` entry (a ``git clone``/``git init`` by the agent, at any
  depth) is added as a gitlink (a commit id, its files lost), or not at all when its
  HEAD is unborn (``git add`` fails); ``.git`` entries themselves are never added.
  Here every such folder, and every ``.git`` folder, is a **unit** of its own: its
  files go to a tree of their own (with a private index), and the enclosing unit's
  ``git add`` excludes it;
* FIFOs, sockets and device nodes are skipped; ``.git`` files and links are never
  added: the manifest lists them (type, mode, content) and restore recreates them;
* hard links come back as separate files: the manifest lists the groups of names that
  share an inode, and restore links them again (and breaks links made since);
* directories (empty ones too), permission bits beyond git's 644/755, and modification
  times (files, links, directories) are in the manifest and restored.

The manifest is a JSON blob in the object store. The same source runs on the host
(:data:`GITSNAP_SOURCE` executed here) and inside a container (``python3 -c``), so both
backends are exact in the same way. Guarantees and limits: docs/swebench.md, "Snapshots".
"""

from __future__ import annotations

from typing import Any

__all__ = ["GITSNAP_SOURCE", "gitsnap"]

#: stdlib-only code; ``git(*args, work=, index=, stdin=)`` runs git on the private store.
GITSNAP_SOURCE = r'''
import hashlib, json, os, shutil, stat

def index_name(unit):
    return "index-" + hashlib.sha1(unit.encode("utf-8", "surrogateescape")).hexdigest()[:20]

def _inside(unit, rel):
    return unit == "" or rel.startswith(unit + "/")

def scan(root):
    """Everything about the folder that git trees do not hold, and its units."""
    dirs, modes, nodes, gitfiles, times, units = {}, {}, {}, {}, {}, [""]
    inodes = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            r = rel + "/" + e.name if rel else e.name
            st = e.stat(follow_symlinks=False)
            mode = stat.S_IMODE(st.st_mode)
            times[r] = st.st_mtime_ns
            if e.name == ".git":
                if rel and rel not in units:
                    units.append(rel)
                if not stat.S_ISDIR(st.st_mode):
                    if stat.S_ISLNK(st.st_mode):
                        gitfiles[r] = ["l", os.readlink(e.path), 0]
                    elif stat.S_ISREG(st.st_mode):
                        with open(e.path, "rb") as f:
                            gitfiles[r] = ["f", f.read().hex(), mode]
                    continue
                units.append(r)
            if stat.S_ISDIR(st.st_mode):
                dirs[r] = mode
                stack.append(r)
            elif stat.S_ISREG(st.st_mode):
                if mode not in (0o644, 0o755):
                    modes[r] = mode
                if st.st_nlink > 1:
                    inodes.setdefault((st.st_dev, st.st_ino), []).append(r)
            elif not stat.S_ISLNK(st.st_mode):
                nodes[r] = [stat.S_IFMT(st.st_mode), mode, st.st_rdev]
    links = sorted(sorted(g) for g in inodes.values() if len(g) > 1)
    return {"dirs": dirs, "modes": modes, "nodes": nodes, "gitfiles": gitfiles,
            "links": links, "times": times, "units": sorted(units)}

def _lit(path):
    return ":(literal)" + path

def add(root, units, git, index_dir, write=True):
    """Bring each unit's private index up to date; return unit -> tree (if write)."""
    trees = {}
    for u in units:
        work = os.path.join(root, u) if u else root
        inner = [v[len(u) + 1:] if u else v for v in units if v != u and _inside(u, v)]
        idx = os.path.join(index_dir, index_name(u))
        excl = [":(exclude,literal)" + v for v in inner]
        git("add", "-A", "-f", "--", ".", *excl, work=work, index=idx)
        nested = [v for v in inner if v != ".git"]
        if nested:  # entries from before a folder became a repository
            git("rm", "-r", "-q", "--cached", "--ignore-unmatch", "--",
                *map(_lit, nested), work=work, index=idx)
        if write:
            trees[u] = git("write-tree", work=work, index=idx).strip()
    return trees

def snapshot(root, git, index_dir):
    """(unit -> tree, manifest blob id)."""
    man = scan(root)
    trees = add(root, man["units"], git, index_dir)
    blob = json.dumps(man, sort_keys=True)
    oid = git("hash-object", "-w", "--stdin", work=root, index=None, stdin=blob).strip()
    return trees, oid

def _rm(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)

def _real_dir(root, rel):
    """Make root/rel a real folder (no link on the way), creating what is missing."""
    cur = root
    for part in rel.split("/"):
        cur = os.path.join(cur, part)
        if os.path.islink(cur) or (os.path.lexists(cur) and not os.path.isdir(cur)):
            os.unlink(cur)
        if not os.path.lexists(cur):
            os.mkdir(cur)

def restore(root, trees, manifest_oid, git, index_dir):
    """Make the folder exactly the snapshot (unit trees + manifest)."""
    man = json.loads(git("cat-file", "blob", manifest_oid, work=root, index=None))
    now = scan(root)
    add(root, now["units"], git, index_dir, write=False)  # so files made since go
    gone = set()
    for u in sorted(set(now["units"]) - set(trees), key=len):
        if not any(_inside(g, u) for g in gone):
            _rm(os.path.join(root, u))
            gone.add(u)
    for u in set(now["units"]) ^ set(trees):
        try:
            os.unlink(os.path.join(index_dir, index_name(u)))
        except FileNotFoundError:
            pass
    for u in sorted(trees, key=lambda u: (u.count("/"), u)):
        work = root
        if u:
            _real_dir(root, u)
            work = os.path.join(root, u)
        git("read-tree", "--reset", "-u", trees[u], work=work,
            index=os.path.join(index_dir, index_name(u)))
    apply_manifest(root, man)

def apply_manifest(root, man):
    now = scan(root)
    P = lambda r: os.path.join(root, r)
    dirty = set()  # entries created or changed below (their times and their folder's)
    def touch(r):
        dirty.add(r)
        dirty.add(r.rpartition("/")[0])
    for r in sorted(set(now["dirs"]) - set(man["dirs"]), key=len, reverse=True):
        if os.path.isdir(P(r)) and not os.path.islink(P(r)):
            shutil.rmtree(P(r))
            touch(r)
    for r in sorted(man["dirs"], key=len):
        if r not in now["dirs"]:
            _real_dir(root, r)
            touch(r)
        if now["dirs"].get(r) != man["dirs"][r]:
            os.chmod(P(r), man["dirs"][r])
    for key in ("nodes", "gitfiles"):
        for r, v in now[key].items():
            if man[key].get(r) != v and os.path.lexists(P(r)):
                os.unlink(P(r))
                touch(r)
        for r, v in man[key].items():
            if now[key].get(r) == v:
                continue
            _rm(P(r))
            touch(r)
            if key == "nodes":
                os.mknod(P(r), v[0] | v[1], v[2])
                os.chmod(P(r), v[1])
            elif v[0] == "l":
                os.symlink(v[1], P(r))
            else:
                with open(P(r), "wb") as f:
                    f.write(bytes.fromhex(v[1]))
                os.chmod(P(r), v[2])
    # Hard links: break the ones made since, then link each snapshot group again.
    want = {r: tuple(g) for g in man["links"] for r in g}
    for g in now["links"]:
        for r in g:
            if want.get(r) != tuple(g):
                tmp = P(r) + ".branchgym-unlink"
                shutil.copy2(P(r), tmp)
                os.replace(tmp, P(r))
                touch(r)
    for g in man["links"]:
        first = os.lstat(P(g[0]))
        for r in g[1:]:
            if os.lstat(P(r)).st_ino != first.st_ino:
                tmp = P(r) + ".branchgym-link"
                os.link(P(g[0]), tmp, follow_symlinks=False)
                os.replace(tmp, P(r))
                touch(r)
    for r, mode in man["modes"].items():
        if now["modes"].get(r) != mode and os.path.isfile(P(r)) and not os.path.islink(P(r)):
            os.chmod(P(r), mode)
    for r, mode in now["modes"].items():
        if r not in man["modes"] and os.path.isfile(P(r)) and not os.path.islink(P(r)):
            os.chmod(P(r), 0o755 if mode & 0o100 else 0o644)  # git's two modes
    # Times last (everything above touches them); folders deepest first.
    times = man["times"]
    cur = now["times"]
    for r in sorted(times, key=lambda r: (r in man["dirs"], -r.count("/"))):
        if r in dirty or cur.get(r) != times[r]:
            try:
                st = os.lstat(P(r))
            except FileNotFoundError:
                continue
            if st.st_mtime_ns != times[r]:
                os.utime(P(r), ns=(st.st_atime_ns, times[r]), follow_symlinks=False)
'''

_ns: dict[str, Any] = {}
exec(compile(GITSNAP_SOURCE, "<gitsnap>", "exec"), _ns)  # noqa: S102 - our own code


class _Namespace:
    """The functions of :data:`GITSNAP_SOURCE` as attributes (``gitsnap.scan`` ...)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return _ns[name]
        except KeyError:
            raise AttributeError(name) from None


#: ``gitsnap.scan(root)``, ``gitsnap.snapshot(root, git, index_dir)``,
#: ``gitsnap.restore(root, trees, manifest_oid, git, index_dir)``.
gitsnap = _Namespace()
