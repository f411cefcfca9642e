"""JSON Schema 2020-12's formats as patterns: one exact grammar per format that is regular or bounded.

    formats.FORMATS["ipv6"].pattern        # an anchored pattern the library's parser and Python's re read alike
    formats.FORMATS["regex"].narrower      # what a grammar leaves out of its format (a sound choice)
    formats.write_patterns(schema, ...)    # each `format` of a schema written as its pattern (keywords.engine_rewrites)

Each grammar is written from the format's own specification (RFC 3339 for `date`, `time`,
`date-time` and `duration`; RFC 5321/6531 for the e-mail forms; RFC 1123/5890 for host names;
RFC 2673/4291 for the IP forms; RFC 3986/3987 for URIs and IRIs; RFC 6570 for URI templates;
RFC 6901 and the relative JSON pointer draft; RFC 4122 for `uuid`; ECMA-262 for `regex`) and never
accepts a string the format's definition refuses. Where the referee (``jsonschema``'s format checker, format assertion on)
has a checker, the grammar accepts only strings it accepts (``tests/structured/test_formats.py``
draws strings from each grammar and judges them); ``Format.narrower`` says in words what a
grammar leaves out of its definition (a sound choice: fewer strings, never more), and
``Format.exact`` whether the grammar is the referee's language itself, which is what a grammar
under `not` needs (:func:`write_patterns` leaves a narrower one alone there).

A format whose language is not regular is written as a regular part of it: `regex` (balanced groups,
a context-free language) as the patterns whose groups nest at most :data:`_REGEX_DEPTH` deep, which both
ECMA-262 and the referee's `re` read. A grammar narrower than its format beside `not` (where it would widen
the schema) stays a `format`, which the engines' lists refuse by name (``keywords.known_format``). A name
outside the standard list is an annotation (never asserted, never refused). Format beside ``pattern`` is the intersection of the
two patterns (``algebra.regular.intersect_patterns``); beside ``minLength``/``maxLength`` the bounds
stay beside the pattern where the engine enforces them there, and are intersected into it where it
does not (a bounded format's own length, `hostname`'s 253, is one more ``maxLength``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from neuron_constrain.structured.schema import rewrite
from neuron_constrain.structured.schema.algebra import caps, lengths, regular
from neuron_constrain.structured.constraints import ConstraintError


@dataclasses.dataclass(frozen=True)
class Format:
    """One format's grammar: ``pattern`` (anchored, a full match), its length bound, what it leaves out."""

    name: str
    pattern: str
    max_length: int | None = None  # code points, beside the pattern (a bounded format)
    narrower: str = ""  # what the grammar leaves out of the format's definition, in words ("" : nothing)
    exact: bool = False  # the grammar is the referee's language itself (its checker, which the stdlib holds)
    nonempty: str | None = None  # the pattern less the empty string, where it takes it (``minLength: 1`` beside)


# --------------------------------------------------------------------------- the pieces (ECMA-262 syntax)
_HEX = "[0-9A-Fa-f]"
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999: Python's date (the referee)
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_HOUR, _MINUTE = "(?:[01][0-9]|2[0-3])", "[0-5][0-9]"
_SECFRAC = "(?:\\.[0-9]+)?"
_TIME = (f"(?:{_HOUR}:{_MINUTE}:{_MINUTE}{_SECFRAC}(?:[Zz]|[+-]{_HOUR}:{_MINUTE})"
         f"|23:59:60{_SECFRAC}(?:[Zz]|[+-]00:00))")
_DUR_TIME = "T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
_DURATION = f"P(?:(?:[0-9]+D|[0-9]+M(?:[0-9]+D)?|[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?)(?:{_DUR_TIME})?|{_DUR_TIME}|[0-9]+W)"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = f"(?:{_OCTET}\\.){{3}}{_OCTET}"
_H16 = f"{_HEX}{{1,4}}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"


def _ipv6() -> str:
    """RFC 3986's IPv6address: nine forms by where `::` stands (it stands for one group or more)."""
    forms = [f"(?:{_H16}:){{6}}{_LS32}", f"::(?:{_H16}:){{5}}{_LS32}"]
    for before, after in ((0, f"(?:{_H16}:){{4}}{_LS32}"), (1, f"(?:{_H16}:){{3}}{_LS32}"),
                          (2, f"(?:{_H16}:){{2}}{_LS32}"), (3, f"{_H16}:{_LS32}"), (4, _LS32), (5, _H16), (6, "")):
        head = _H16 if before == 0 else f"(?:{_H16}:){{0,{before}}}{_H16}"
        forms.append(f"(?:{head})?::{after}")
    return "(?:" + "|".join(forms) + ")"


_IPV6 = _ipv6()
_LETTER_DIGIT = "[A-Za-z0-9]"


def _label(letter_digit: str, hyphenated: str) -> str:
    """A host-name label of 1-63 characters: letters and digits at its ends, hyphens inside, never `--` as
    its 3rd and 4th characters (RFC 5891's reserved form, an A-label's `xn--`)."""
    ld, h = letter_digit, hyphenated
    return f"(?:{ld}(?:{h}?{ld})?|{ld}{h}(?:{ld}|-){ld}|{ld}{h}(?:{ld}{h}|-{ld}){h}{{0,58}}{ld})"


_HOST_LABEL = _label(_LETTER_DIGIT, "[A-Za-z0-9-]")
_IDN_LABEL = _label("[a-z0-9]", "[a-z0-9-]")
_ATEXT = "A-Za-z0-9!#$%&'*+/=?^_`{|}~\\-"
_QTEXT = "\\x20\\x21\\x23-\\x5B\\x5D-\\x7E"
_NON_ASCII = "\\x80-\U0010FFFF"
_ADDRESS_LITERAL = f"\\[(?:{_IPV4}|IPv6:{_IPV6})\\]"
_DOMAIN = f"[A-Za-z0-9](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?(?:\\.[A-Za-z0-9](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?)*"


def _mailbox(extra: str) -> str:
    """RFC 5321's Mailbox (``extra``: RFC 6531's UTF8-non-ascii in atext and qtext)."""
    atom = f"[{_ATEXT}{extra}]+"
    quoted = f"\"(?:[{_QTEXT}{extra}]|\\\\[\\x20-\\x7E])*\""
    return f"(?:{atom}(?:\\.{atom})*|{quoted})@(?:{_DOMAIN}|{_ADDRESS_LITERAL})"


# RFC 3986 (``extra``: RFC 3987's ucschar; ``private``: its iprivate, in queries)
_UCSCHAR = ("\\xA0-\\uD7FF\\uF900-\\uFDCF\\uFDF0-\\uFFEF" + "".join(
    f"{chr(plane * 0x10000)}-{chr(plane * 0x10000 + 0xFFFD)}" for plane in range(1, 14))
    + f"{chr(0xE1000)}-{chr(0xEFFFD)}")
_IPRIVATE = f"\\uE000-\\uF8FF{chr(0xF0000)}-{chr(0xFFFFD)}{chr(0x100000)}-{chr(0x10FFFD)}"
_UNRESERVED, _SUB_DELIMS = "A-Za-z0-9\\-._~", "!$&'()*+,;="


def _uri(extra: str = "", private: str = "") -> tuple[str, str]:
    """``(absolute, reference)``: RFC 3986's URI and URI-reference (RFC 3987's IRI forms with ``extra``)."""
    pct = f"%{_HEX}{_HEX}"
    pchar = f"(?:[{_UNRESERVED}{extra}{_SUB_DELIMS}:@]|{pct})"
    segment, query = f"{pchar}*", f"(?:{pchar}|[/?{private}])*"
    ip_literal = f"\\[(?:{_IPV6}|v{_HEX}+\\.[{_UNRESERVED}{_SUB_DELIMS}:]+)\\]"
    host = f"(?:{ip_literal}|(?:[{_UNRESERVED}{extra}{_SUB_DELIMS}]|{pct})*)"
    authority = f"(?:(?:[{_UNRESERVED}{extra}{_SUB_DELIMS}:]|{pct})*@)?{host}(?::[0-9]*)?"
    absolute_path = f"/(?:{pchar}+(?:/{segment})*)?"
    tail = f"(?:\\?{query})?(?:#{query})?"
    hier = f"(?://{authority}(?:/{segment})*|{absolute_path}|{pchar}+(?:/{segment})*)?"
    no_scheme = f"(?:[{_UNRESERVED}{extra}{_SUB_DELIMS}@]|{pct})+(?:/{segment})*"
    absolute = f"[A-Za-z][A-Za-z0-9+.-]*:{hier}{tail}"
    relative = f"(?://{authority}(?:/{segment})*|{absolute_path}|{no_scheme})?{tail}"
    return absolute, f"(?:{absolute}|{relative})"


_URI, _URI_REFERENCE = _uri()
_IRI, _IRI_REFERENCE = _uri(_UCSCHAR, _IPRIVATE)
_PCT = f"%{_HEX}{_HEX}"
_VARCHAR = f"(?:[A-Za-z0-9_]|{_PCT})"
_VARSPEC = f"{_VARCHAR}(?:\\.?{_VARCHAR})*(?::[1-9][0-9]{{0,3}}|\\*)?"
_URI_TEMPLATE = (f"(?:[\\x21\\x23\\x24\\x26\\x28-\\x3B\\x3D\\x3F-\\x5B\\x5D\\x5F\\x61-\\x7A\\x7E{_UCSCHAR}{_IPRIVATE}]"
                 f"|{_PCT}|\\{{[+#./;?&]?{_VARSPEC}(?:,{_VARSPEC})*\\}})*")
_JSON_POINTER = "(?:/(?:[^~/]|~[01])*)*"


def _ordered_ranges(low: str, high: str) -> str:
    """Every class range ``x-y`` with ``low <= x <= y <= high`` (a range out of order is an error in both readers)."""
    return "|".join(f"{c}-[{c}-{high}]" for c in map(chr, range(ord(low), ord(high) + 1)))


# ECMA-262 regular expressions (`regex`) are not a regular language, but those nesting groups at most
# _REGEX_DEPTH deep are; the grammar writes such a subset both ECMA-262 (u flag) and Python's `re` (the
# referee's checker) read: literal characters, `.`, escapes of classes, controls and syntax characters,
# classes of characters, escapes and ordered ranges (a `-` first or last), the quantifiers with lazy forms (`{n,m}` with n <= m
# written for counts of different lengths or one digit), groups and non-capturing groups, `|`; anchors and
# word boundaries outside groups only (a group holding only assertions cannot be quantified in ECMA-262).
_REGEX_DEPTH = 3
_SYNTAX_ESCAPES = "\\\\^$.*+?()\\[\\]{}|/"
_REGEX_LITERAL = "[^\\\\^$.|?*+()\\[\\]{}\\x00-\\x1f\\ud800-\\udfff]"
_REGEX_ESCAPE = f"\\\\[dDwWsSnrtfv{_SYNTAX_ESCAPES}]"
_CLASS_ITEM = (f"(?:{_ordered_ranges('a', 'z')}|{_ordered_ranges('A', 'Z')}|{_ordered_ranges('0', '9')}"
               f"|[^\\\\\\]\\[\\-&~|^\\x00-\\x1f\\ud800-\\udfff]|\\\\[dDwWsSnrtfv\\-{_SYNTAX_ESCAPES}])")
_COUNT_N = "(?:0|[1-9][0-9]{0,3})"
_COUNTS = "|".join(f"{n},[{n}-9]" for n in range(10))
_QUANTIFIER = (f"(?:(?:[*+?]|\\{{(?:{_COUNT_N},?|{_COUNTS}|[0-9],[1-9][0-9]{{1,3}}|[1-9][0-9],[1-9][0-9]{{2,3}}"
               f"|[1-9][0-9]{{2}},[1-9][0-9]{{3}})\\}})\\??)")


def _regex(depth: int, top: bool = True, repeat: str = "*") -> str:
    """The subset above, groups nesting ``depth`` deep at most (``top``: the outermost level, where anchors stand);
    ``repeat="+"``: at least one character (each item is one or more)."""
    atom = f"(?:{_REGEX_LITERAL}|\\.|{_REGEX_ESCAPE}|\\[\\^?(?:-?{_CLASS_ITEM}+-?|-)\\]" + (
        f"|\\((?:\\?:)?{_regex(depth - 1, False)}\\)" if depth else "") + ")"
    return f"(?:{atom}{_QUANTIFIER}?" + ("|[\\^$]|\\\\[bB]" if top else "") + f"|\\|){repeat}"


def _format(name: str, body: str, **rest) -> Format:
    return Format(name, f"^{body}$", **rest)


FORMATS = {f.name: f for f in (
    _format("date", _DATE, exact=True),
    _format("time", _TIME, narrower="a leap second only at 23:59:60 UTC written with offset Z or 00:00"),
    _format("date-time", f"{_DATE}[Tt]{_TIME}", narrower="years 0001-9999 (Python's calendar); a leap second only at "
            "23:59:60 UTC written with offset Z or 00:00"),
    _format("duration", _DURATION, narrower="upper-case designators only (`P1D`; ABNF also reads `p1d`)"),
    _format("email", _mailbox(""), narrower="no General-address-literal, the `IPv6:` tag as written; host labels "
            "of at most 63 characters "
            "(RFC 5321's size limits, 4.5.3.1, are not written)"),
    _format("idn-email", _mailbox(_NON_ASCII), narrower="an ASCII domain (no U-labels); no General-address-literal"),
    _format("hostname", f"{_HOST_LABEL}(?:\\.{_HOST_LABEL})*", max_length=253,
            narrower="no label with `--` as its 3rd and 4th characters (RFC 5891's reserved labels, `xn--`)"),
    _format("idn-hostname", f"{_IDN_LABEL}(?:\\.{_IDN_LABEL})*", max_length=253,
            narrower="ASCII lower-case labels only (no U-labels, no A-labels): IDNA2008's validity of a non-ASCII "
                     "label (contextual rules, bidi) is not written"),
    _format("ipv4", _IPV4, exact=True),
    _format("ipv6", _IPV6, exact=True),
    _format("uri", _URI),
    _format("uri-reference", _URI_REFERENCE),
    _format("iri", _IRI),
    _format("iri-reference", _IRI_REFERENCE),
    _format("uuid", f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
            narrower="the 8-4-4-4-12 form only (Python's UUID, the referee, also reads prefixes and more hyphens)"),
    _format("uri-template", _URI_TEMPLATE, narrower="no reserved operators (`=` `,` `!` `@` `|`)"),
    _format("json-pointer", _JSON_POINTER),
    _format("relative-json-pointer", f"(?:0|[1-9][0-9]*)(?:#|{_JSON_POINTER})",
            narrower="no index manipulation (`0+1/a`, a later draft's)"),
    _format("regex", _regex(_REGEX_DEPTH), narrower=f"groups nested at most {_REGEX_DEPTH} deep, no lookarounds, "
            "named groups or back-references; anchors and word boundaries outside groups; `{n,m}` written where n and "
            "m have one digit or different lengths", nonempty=f"^{_regex(_REGEX_DEPTH, repeat='+')}$"),
)}
def grammar(name: str) -> Format | None:
    """The grammar of a format.

    Args:
        name: the format's name (``"date-time"``).

    Returns:
        Its :class:`Format`, or None (a format refused by name, or a name outside the standard list).
    """
    return FORMATS.get(name)


def checked(name: str) -> bool:
    """Whether the referee (``jsonschema``'s 2020-12 format checker) asserts a format here.

    Args:
        name: the format's name.

    Returns:
        False where the checker's optional package is absent: the referee then accepts any string (it cannot judge).
    """
    import jsonschema

    return name in jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers


_BOUNDED_PATTERN = {"type": "string", "pattern": "^a+$", "minLength": 1, "maxLength": 2}


def lengths_beside_pattern(why_not: Callable[[str, dict, dict], "str | None"]) -> bool:
    """Whether an engine (``why_not``: its ``keywords.Allowlist.why_not``) enforces ``minLength`` and
    ``maxLength`` beside a ``pattern``.

    Args:
        why_not: ``(keyword, node, root) -> None`` where the engine enforces ``keyword`` in ``node``, else why not.

    Returns:
        True where both bounds are enforced beside a pattern (they then stay beside the format's pattern).
    """
    return all(why_not(k, _BOUNDED_PATTERN, _BOUNDED_PATTERN) is None for k in ("minLength", "maxLength"))


def write_patterns(schema: dict, lengths_beside_pattern: bool, narrowed: list | None = None) -> None:
    """Each ``format`` of ``schema`` (modified in place) with a grammar here written as a ``pattern``,
    intersected with the node's own pattern; its length bounds kept beside (``lengths_beside_pattern``:
    the engine enforces them there) or intersected into the pattern. A grammar that is not the referee's
    language is left as ``format`` in a schema with `not`/`if`/`oneOf` (where it, or a `$ref` to it,
    would widen what the schema accepts), and so is a node whose intersection a cap refuses (the
    policy then judges it).

    Args:
        schema: a schema object, rewritten in place.
        lengths_beside_pattern: the engine enforces ``minLength``/``maxLength`` beside a ``pattern``
            (:func:`lengths_beside_pattern`).
        narrowed: receives the JSON pointers of the nodes given a grammar narrower than their format.
    """
    nodes = list(rewrite.walk(schema))
    negating = any(rewrite.NEGATING & set(node) for _, node in nodes)
    for path, node in nodes:
        found = grammar(node["format"]) if isinstance(node.get("format"), str) else None
        if found is None or (negating and not found.exact):
            continue
        written = _written(node, found)
        if written is None:
            continue
        pattern, low, high = written
        if low == 1 and pattern == found.pattern:  # the format's own automaton may be too large to intersect
            if re.fullmatch(pattern, "") is None or found.nonempty:
                pattern, low = found.nonempty or pattern, 0
                node.pop("minLength", None)
        if not lengths_beside_pattern and (low or high is not None):
            bounded = lengths.within(pattern, low, high)
            if bounded is not None and bounded[1]:  # exact only: a narrower format grammar is listed by itself
                pattern, low, high = bounded[0], 0, None
                node.pop("minLength", None)
                node.pop("maxLength", None)
        del node["format"]
        node["pattern"] = pattern
        if high is not None:
            node["maxLength"] = high
        if found.narrower and narrowed is not None:
            narrowed.append(path)


def _written(node: dict, found: Format) -> tuple[str, int, int | None] | None:
    """The node's pattern once its format is written in, and its length bounds; None where it cannot be."""
    pattern = found.pattern
    if "pattern" in node:
        if not isinstance(node["pattern"], str):
            return None  # a malformed pattern: left for the policy to name, never overwritten
        pattern = _intersect((node["pattern"], found.pattern))
        if pattern is None:
            return None
    low = node.get("minLength", 0)
    high = node.get("maxLength")
    if not isinstance(low, int) or (high is not None and not isinstance(high, int)):
        return None  # a malformed bound: the policy names it
    if found.max_length is not None:
        high = found.max_length if high is None else min(high, found.max_length)
    return pattern, low, high


def _intersect(sources: tuple) -> str | None:
    """The patterns' intersection, or None where it cannot be written (a refused feature, no string, a cap)."""
    try:
        written = regular.intersect_patterns(sources)
    except (caps.Over, ConstraintError):
        return None
    return written if isinstance(written, str) else None

