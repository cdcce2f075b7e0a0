package relay

// SetAfterBackfillCheck sets r's hook run between the backfill check and
// the start of a session; call it before Run.
func SetAfterBackfillCheck(r *Relay, f func()) { r.afterBackfillCheck = f }
