// Package records is the one owner of the VM records of both families
// (classic VMs and AppVMs): the registry of every record, in memory and in
// its store (<state>/vms/<id>.json, 0600), the per-VM locks that serialize
// the actions on one VM, staged writes, and the change events the views
// and the event log follow. It sits below vm, vm/engine and appvm: the
// wiring opens one Registry first and hands it to each, and every change of
// a record goes through it, so none is missed and none is told twice.
//
// # Records
//
// Records are copy-on-write: a *record.Record handed out is never modified
// again, so readers hold no lock; Update applies a change to a copy and
// stores the copy. The writes of one record are serialized and stored in
// order; writes of different records run side by side, so their fsyncs
// share the file system's journal commits, and no fsync happens under the
// lock readers take. Open loads the store: a damaged record is moved aside
// (store.Load), a JSON object that is not a record is left in place, and a
// record whose file name is not a valid id loads as a failed VM
// (detail.kind invalid_vm_id, cause record_invalid); Report says what it
// found.
//
// # Creates in flight
//
// Reserve claims an id for a create that passed admission, before its
// record is stored: it holds the id (one namespace for both families) and
// counts in later admissions, so of concurrent creates of one id exactly
// one wins. Create stores the record and ends the reservation; Release
// drops one never stored.
//
// # Staged writes
//
// Stage applies a change in memory only: readers and watchers see it at
// once, the record's next write (Update, or Save alone) stores it. A create
// with auto_boot stages its provision's result so that the boot's write
// stores both: two record writes before the answer, the create's intent
// and the boot. An agent that dies in between finds the record as last
// stored.
//
// # Locks
//
// Lock takes the per-VM action lock: lifecycle actions, volume changes,
// spec edits, redeploys and the engine's own deadlines hold it, so one VM
// sees one action at a time. Its entry lives only while held or awaited.
//
// # Change events
//
// Watch registers a function told every change after it is made (Change:
// the record before and after), in the order the changes of one record
// were made. Watchers run on the writer's goroutine with the record's
// write lock held: they must be quick, must not write records, and must
// not wait for a lock a writer may hold. Publish turns the changes into
// the event log's events (docs/api.md, Events).
package records
