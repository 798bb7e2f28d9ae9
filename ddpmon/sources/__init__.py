"""Live readings taken at scrape time (NVML, torch allocator, psutil), each injectable for tests."""
