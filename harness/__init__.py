"""Running engines and measuring them: sessions, guards, timing, plans and the result store."""
