package probe

// SelfPodsCgroup exposes selfPodsCgroup to the package's external tests.
var SelfPodsCgroup = selfPodsCgroup
