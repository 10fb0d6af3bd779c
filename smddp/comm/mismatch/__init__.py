"""What must agree across ranks, and the words when it does not: a call's fingerprint
(``fingerprint``) and the flat communicators' checked collectives (``checked``)."""
