"""The dialect-free core: a body to the job (job.py), the job run (run.py), its items read into the
events every dialect shapes (events.py), the bodies' bounds
(schemas.py, conversation.py, tagged.py, images.py). See daemon/http/__init__.py."""
