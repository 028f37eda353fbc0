"""The dialect-free core: a body to the job (job.py), the job run and its items read (run.py), the bodies' bounds
(schemas.py, conversation.py, tagged.py, images.py). See daemon/http/__init__.py."""
