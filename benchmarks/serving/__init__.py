"""bench_serving's parts: config, text and workloads, arrival, client, runner, stats, scrape, report, plots,
compare."""
