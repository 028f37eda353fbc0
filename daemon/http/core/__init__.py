"""The dialect-free core: a request body to the internal job, run, its events out (see daemon/http/__init__.py)."""
