"""What the tests share: scraping, paging through a real stack, promtool runs, torchrun jobs,
certificates, the order xdist takes the suite in, synthetic logs and the real logs' record counts."""
