"""The student side: the client that reaches a teacher, and a distillation trainer built on it."""

from student_trainer.client import TeacherClient, TeacherInfo
from student_trainer.errors import TeacherError
from student_trainer.session import TeacherOutput

__all__ = ["TeacherClient", "TeacherInfo", "TeacherOutput", "TeacherError"]
