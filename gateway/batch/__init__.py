"""OpenAI's Files and Batch API, run only in idle capacity: the durable store of files,
batches and line results (`store.py`, SQL in `sql.py`), a batch input's lines checked with the
online routes' validators (`lines.py`), one line run through the online admission path
(`line_run.py`), the runner that feeds lines while online demand leaves room (`runner.py`,
idle judged in `idle.py`), and the output and error files (`finalize.py`)."""
