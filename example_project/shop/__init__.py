"""The example Scrapy project: a spider for the bundled local test shop (:mod:`shop.site`).

Importing this package imports nothing else, so :mod:`shop.site` stays usable without Scrapy.
"""
