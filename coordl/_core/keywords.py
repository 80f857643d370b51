"""An unknown keyword argument named with the nearest one the function takes (``cache_byte=``)."""

import difflib
import functools
import inspect


def suggest_keywords(function):
    """Wrap ``function`` so that a keyword it does not take raises Python's ``TypeError`` with the nearest
    keyword it does take; the signature (``inspect.signature``) stays ``function``'s."""
    known = [p.name for p in inspect.signature(function).parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(function)
    def checked(*args, **kwargs):
        for name in kwargs:
            if name not in known:
                nearest = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
                raise TypeError(f"{function.__qualname__}() got an unexpected keyword argument {name!r}{hint}")
        return function(*args, **kwargs)

    return checked
