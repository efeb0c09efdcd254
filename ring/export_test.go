package ring

// KeepReleased makes c leave the records it releases as they are, also in
// builds with invariants: the golden ring image pins the bytes a
// non-poisoning consumer (the Python client, a release build) leaves behind.
func KeepReleased(c *Consumer) { c.poison = false }
