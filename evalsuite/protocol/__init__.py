"""What a task is and the sides it observes: `Side`, recordings, the `Task` protocol. Imports the wings below
it (`backends`, `formats`, `contract`, `files`, `inputs`, `stats`)."""
