"""Start-up hook of every Python process of a compatibility run (``compat/run.py`` puts this
folder first on ``PYTHONPATH``): force the add-on on for each Scrapy crawler."""

import idempotent_forced

idempotent_forced.install()
