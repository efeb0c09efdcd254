package machine

import "fmt"

// What the external tests (package machine_test, which drive the Machine
// through machinetest.Env) may see of its insides.

// StoreWaiters is the number of acquires that l2.stored keeps waiting for
// an engine's store of block d of session s's namespace.
func (m *Machine) StoreWaiters(s SessionID, d []byte) int {
	sess := m.sessions[s]
	if sess == nil || m.l2 == nil {
		return 0
	}
	if sw := m.l2.stored[fillKey(sess.inst.ns.id, d)]; sw != nil {
		return len(sw.waiters)
	}
	return 0
}

// Leftover reports what the Machine still counts once every session and
// every copy and call of the tier ended: nothing, or the idle namespaces'
// own metadata.
func (m *Machine) Leftover() error {
	if m.total != (usage{}) && m.total.meta != int64(len(m.namespaces))*namespaceMeta {
		return fmt.Errorf("usage left after the end: %+v", m.total)
	}
	return nil
}
