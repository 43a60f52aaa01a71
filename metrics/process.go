package metrics

import "runtime"

// WriteProcess writes the agent's own metrics: the process's (CPU time,
// memory, descriptors, start time; Linux only) and the Go runtime's.
func WriteProcess(w *Writer) {
	writeProcess(w)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	w.Family("go_goroutines", Gauge, "Number of goroutines that currently exist.")
	w.Sample("go_goroutines", float64(runtime.NumGoroutine()))
	w.Family("go_info", Gauge, "Information about the Go environment.")
	w.Sample("go_info", 1, "version", runtime.Version())
	w.Family("go_memstats_heap_alloc_bytes", Gauge, "Number of heap bytes allocated and still in use.")
	w.Sample("go_memstats_heap_alloc_bytes", float64(ms.HeapAlloc))
	w.Family("go_memstats_sys_bytes", Gauge, "Number of bytes obtained from the system.")
	w.Sample("go_memstats_sys_bytes", float64(ms.Sys))
	w.Family("go_gc_cycles_total", Counter, "Number of completed GC cycles.")
	w.Sample("go_gc_cycles_total", float64(ms.NumGC))
}
